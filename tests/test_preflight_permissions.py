"""The permissions check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py): the launcher's access asked of the real RBAC authorizer, as an account bound to deploy/rbac*.yaml
less the rules a test cuts (deploy_grants), as the pipeline runner for a TrainJob, and as a Kubeflow profile's
default-editor with what render-rbac --kubeflow-profile adds (the ``kubeflow`` fixture)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from components.launch_training.platform import Platform
from components.launch_training.trainjob import TRAINJOB
from components.preflight.access import RBAC_JOB_APIS, launcher_access
from components.preflight.result import FAIL, PASS, WARN
from tests.cluster.control_plane import LESS_GRANTED, deploy_grants
from tests.preflight_helpers import (
    TRAINJOB_PLATFORM,
    Site,
    all_pass,
    check,
    needs_trainer,
    others_pass,
    runtime_applied,
    statuses,
    trainjob_runtime,
)


def test_permissions_missing_create_pytorchjobs_fails(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants(without=("create pytorchjobs", "get pods/log", "list events")))
    result = site.run()
    permissions = check(result, "permissions")
    assert permissions.status == FAIL
    assert permissions.reason == (
        f"{site.namespace}/{LESS_GRANTED} may not, in namespace {site.namespace}: create pytorchjobs.kubeflow.org, get "
        "pods/log; also list events (the pods' events)"
    )
    assert permissions.fix == (
        f"hyperpod-pretrain render-rbac --namespace {site.namespace} --service-account "
        f"{LESS_GRANTED} --job-api pytorchjob | kubectl apply -f -"
    )
    others_pass(result, "permissions")


def test_permissions_missing_list_events_warns(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants(without=("list events",)))
    result = site.run()
    permissions = check(result, "permissions")
    assert permissions.status == WARN and result.passed
    assert permissions.reason == (
        f"{site.namespace}/{LESS_GRANTED} may not list events in {site.namespace}: the "
        "launcher runs but cannot show the pods' events"
    )
    assert permissions.fix.startswith(f"hyperpod-pretrain render-rbac --namespace {site.namespace} ")


def test_permissions_in_a_namespace_rbac_yaml_does_not_cover(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants())  # an account of the test's own: the runner meets no 403
    team = site.hp.namespace(f"hyperpod-team-{site.hp.tag}")
    site.hp.add_pvc(team, "fsx-lustre-pvc")
    permissions = check(site.run(namespace=team), "permissions")
    assert permissions.status == FAIL and permissions.reason.startswith(
        f"{site.namespace}/{LESS_GRANTED} may not, in namespace {team}: create pytorchjobs.kubeflow.org, get "
        "pytorchjobs.kubeflow.org, watch pytorchjobs.kubeflow.org, delete pytorchjobs.kubeflow.org, watch pods, get "
        "pods/log; also list events"  # list pods: granted in every namespace by deploy/rbac-cluster-read.yaml
    )
    assert permissions.fix == (
        f"hyperpod-pretrain render-rbac --namespace {site.namespace} --jobs-namespace "
        f"{team} --service-account {LESS_GRANTED} --job-api pytorchjob | kubectl apply -f "
        "-"
    )


@pytest.mark.parametrize("api", RBAC_JOB_APIS)
def test_a_kubeflow_profiles_default_editor_passes_with_what_kubeflow_and_render_rbac_grant(
    api: str, make_site: Callable[..., Site], kubeflow: None
) -> None:
    """A profile's namespace, as its default-editor: every check passes, and the permissions check names who grants
    the launcher's access (Kubeflow's roles through kubeflow-edit, render-rbac's for the rest: none here)."""
    if api == TRAINJOB.name:
        needs_trainer()
    site = make_site(profile=api)
    platform = TRAINJOB_PLATFORM if api == TRAINJOB.name else Platform()
    with contextlib.ExitStack() as stack:
        if api == TRAINJOB.name:
            site.hp.add_trainer()
            stack.enter_context(runtime_applied(site.plane, trainjob_runtime(site)))
        result = site.run(platform=platform)
    assert statuses(result) == all_pass(api=api), result.markdown()
    job_role = "kubeflow-trainer-edit" if api == TRAINJOB.name else "kubeflow-training-edit"
    # A TrainJob's JobSet (a new attempt waits for it to go) is not Kubeflow's to grant: render-rbac's Role does. Its
    # Jobs (a delete waits until they are gone or going) are listed under kubeflow-kubernetes-view's grant.
    count, ours, views = (10, "1 from render-rbac's Roles; ", 5) if api == TRAINJOB.name else (8, "", 4)
    assert check(result, "permissions").reason == (
        f"all {count} permissions the launcher uses, in namespace {site.namespace}, for {site.namespace}/default-editor"
        f" (4 from Kubeflow's {job_role} (kubeflow-edit); {ours}{views} from Kubeflow's kubeflow-kubernetes-view "
        "(kubeflow-edit))"
    )


def test_a_trainjob_preflight_asks_for_the_trainjob_verbs(trainer_site: Site) -> None:
    """launcher_access(TRAINJOB): the launcher's TrainJob verbs (deploy/rbac-trainjob.yaml's Role) and the pods', not
    the PyTorchJob's: granted by the deploy files, and the ones named when cut."""
    site = trainer_site
    permissions = check(site.run(platform=TRAINJOB_PLATFORM), "permissions")
    assert len(launcher_access(TRAINJOB)) == 10 and {a[1:3] for a in launcher_access(TRAINJOB)} == {
        ("trainer.kubeflow.org", "trainjobs"),
        ("jobset.x-k8s.io", "jobsets"),
        ("batch", "jobs"),
        ("", "pods"),
        ("", "events"),
    }
    assert (permissions.status, permissions.reason) == (
        PASS,
        "all 10 permissions the launcher uses, in namespace "
        f"{site.namespace}, for kubeflow/pipeline-runner (10 from "
        "render-rbac's Roles)",
    )
    pytorchjobs_cut = site.with_grants(deploy_grants(without=("create pytorchjobs", "delete pytorchjobs")))
    assert check(pytorchjobs_cut.run(platform=TRAINJOB_PLATFORM), "permissions").status == PASS
    trainjobs_cut = site.with_grants(deploy_grants(without=("create trainjobs", "watch trainjobs")))
    permissions = check(trainjobs_cut.run(platform=TRAINJOB_PLATFORM), "permissions")
    assert (permissions.status, permissions.reason) == (
        FAIL,
        f"{trainjobs_cut.namespace}/{LESS_GRANTED} may not, "
        f"in namespace {trainjobs_cut.namespace}: create "
        "trainjobs.trainer.kubeflow.org, watch "
        "trainjobs.trainer.kubeflow.org",
    )
    assert check(trainjobs_cut.run(), "permissions").status == PASS, "a PyTorchJob's verbs are all there"

"""A pipeline compiled for TrainJobs (Kubeflow Trainer v2), on the real control plane (tests/cluster/; the cluster
each test writes: make_site and trainer_site in tests/conftest.py): the crd check against Kubeflow Trainer's install
(and against the Training Operator's, for either compiled choice), and the runtime check of our ClusterTrainingRuntime
(named hyperpod-pretrain, as deploy/rbac-trainjob.yaml lets the runner read only that one: cluster-scoped, so each test
that makes it deletes it: runtime_applied). The queue check is in tests/test_preflight_kueue.py, the TrainJob's
permissions in tests/test_preflight_permissions.py."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from components.launch_training.platform import Platform
from components.launch_training.trainjob import TRAINJOB
from components.preflight.result import FAIL, PASS, failure_message
from tests.cluster.control_plane import PYTORCHJOB_CRD, REPO, TRAINER_CRDS, ControlPlane, audit_time
from tests.preflight_helpers import (
    QUEUE,
    RUNTIMES,
    TRAINJOB_PLATFORM,
    Site,
    all_pass,
    check,
    needs_trainer,
    others_pass,
    runner_reads,
    runtime_applied,
    statuses,
    trainjob_runtime,
)

DEPLOY_RUNTIME = REPO / "deploy/trainjob-runtime.yaml"

TRAINER_CRD_REASON = (
    "trainjobs.trainer.kubeflow.org v1alpha1 installed; Kubeflow Trainer v2.3.0 "
    "(kubeflow-system/kubeflow-trainer-public)"
)


@pytest.fixture
def trainer_spare(control_plane: ControlPlane, tmp_path: Path) -> Iterator[ControlPlane]:
    """A spare API server with Kubeflow Trainer v2.3.0's and JobSet v0.12.0's CRDs and no PyTorchJob CRD: a cluster
    that has Kubeflow Trainer v2 alone."""
    needs_trainer()
    with control_plane.spare(tmp_path / "spare", list(TRAINER_CRDS)) as plane:
        yield plane


def test_a_cluster_with_kubeflow_trainer_alone_names_the_fix_in_one_line(
    trainer_spare: ControlPlane, make_site: Callable[..., Site]
) -> None:
    """Compiled for PyTorchJobs on a cluster with Kubeflow Trainer v2 alone: the crd check fails with the one line that
    says what to do, the version read from Trainer's public ConfigMap. Compiled for TrainJobs: the crd check passes,
    and the runtime check with our ClusterTrainingRuntime applied (without it: fails, naming how to apply it)."""
    site = make_site(plane=trainer_spare, operator=None)
    site.hp.add_trainer()
    since = audit_time()
    pytorchjob = site.run()
    crd = check(pytorchjob, "crd")
    assert (crd.status, crd.reason, crd.fix) == (
        FAIL,
        "this cluster has Kubeflow Trainer v2.3.0 and no PyTorchJob "
        "CRD: compile with --job-api trainjob and apply "
        "deploy/trainjob-runtime.yaml",
        "",
    )
    assert failure_message(pytorchjob) == f"preflight failed: crd: {crd.reason}."
    others_pass(pytorchjob, "crd")

    trainjob = site.run(platform=TRAINJOB_PLATFORM)
    crd, runtime = check(trainjob, "crd"), check(trainjob, "runtime")
    assert (crd.status, crd.reason, crd.fix) == (PASS, TRAINER_CRD_REASON, "")
    assert (runtime.status, runtime.reason) == (
        FAIL,
        "ClusterTrainingRuntime hyperpod-pretrain is not installed: every TrainJob of this pipeline names it",
    )
    assert runtime.fix == (
        "apply deploy/trainjob-runtime.yaml, or what `hyperpod-pretrain render-runtime` prints for "
        "this pipeline's settings (a cluster admin: ClusterTrainingRuntimes are "
        "cluster-scoped)"
    )
    others_pass(trainjob, "runtime")
    assert trainjob.target.startswith(f"TrainJob `{site.namespace}/hpp-pf-1-train-")

    with runtime_applied(trainer_spare, trainjob_runtime(site)):
        applied = site.run(platform=TRAINJOB_PLATFORM)
    assert statuses(applied) == all_pass(api=TRAINJOB.name), applied.markdown()
    assert (
        check(applied, "runtime").reason == "ClusterTrainingRuntime hyperpod-pretrain matches this pipeline's "
        "(restart budget 3)"
    )
    reads = runner_reads(site, since)
    # The version from the ConfigMap Trainer lets every authenticated user read (manifests/base/rbac/
    # public_configmap_role*.yaml), not from its Deployment; nothing the runner asked was refused.
    assert ("get", "configmaps", "kubeflow-system", "kubeflow-trainer-public", 200) in reads
    assert not {r for r in reads if r[1] == "deployments" and r[2] == "kubeflow-system"}
    assert ("get", "customresourcedefinitions", "", "trainjobs.trainer.kubeflow.org", 200) in reads
    assert ("get", RUNTIMES, "", "hyperpod-pretrain", 404) in reads and (
        "get",
        RUNTIMES,
        "",
        "hyperpod-pretrain",
        200,
    ) in reads
    assert not [r for r in reads if r[4] == 403], reads


def test_a_cluster_with_the_training_operator_alone_names_pytorchjob(
    spare: ControlPlane, make_site: Callable[..., Site]
) -> None:
    spare.install_crd(PYTORCHJOB_CRD)
    result = make_site(plane=spare).run(platform=TRAINJOB_PLATFORM)
    crd = check(result, "crd")
    assert (crd.status, crd.reason, crd.fix) == (
        FAIL,
        "this cluster has the Kubeflow Training Operator (PyTorchJob) "
        "and no TrainJob CRD: compile with --job-api pytorchjob",
        "",
    )
    assert check(result, "runtime").status == FAIL, "no ClusterTrainingRuntime API either"


def test_with_both_job_apis_each_compiled_choice_passes_with_its_own(trainer_site: Site) -> None:
    """The shared control plane has both CRDs, the Training Operator and Kubeflow Trainer: a pipeline compiled for
    either passes, each crd check naming its own API; the TrainJob's runtime is deploy/trainjob-runtime.yaml."""
    site, ns = trainer_site, trainer_site.namespace
    pytorchjob = site.run()
    assert statuses(pytorchjob) == all_pass(), pytorchjob.markdown()
    assert check(pytorchjob, "crd").reason == (
        "pytorchjobs.kubeflow.org v1 installed; Training Operator v1.8.1 (kubeflow/training-operator, image tag "
        "v1-04f9f13)"
    )
    with runtime_applied(site.plane, yaml.safe_load(DEPLOY_RUNTIME.read_text())):
        trainjob = site.run(platform=TRAINJOB_PLATFORM)
    assert statuses(trainjob) == all_pass(api=TRAINJOB.name), trainjob.markdown()
    assert trainjob.passed and trainjob.verdict() == "passed"
    assert check(trainjob, "crd").reason == TRAINER_CRD_REASON
    assert (
        check(trainjob, "runtime").reason == "ClusterTrainingRuntime hyperpod-pretrain matches this pipeline's "
        "(restart budget 3)"
    )
    assert check(trainjob, "queue").reason == "no Kueue queue compiled in: the job starts when its pods fit"
    # The pod the runtime and the TrainJob make together, checked as a PyTorchJob's worker is.
    assert check(trainjob, "nodes").reason == check(pytorchjob, "nodes").reason
    assert check(trainjob, "memory").reason == check(pytorchjob, "memory").reason
    assert check(trainjob, "fsx-pvc").reason == f"fsx-lustre-pvc in {ns}: Bound, ReadWriteMany, 1200Gi"
    assert trainjob.target.startswith(f"TrainJob `{ns}/hpp-pf-1-train-") and "2 node(s) of ml.p5.48xlarge" in (
        trainjob.target
    )


def test_a_runtime_that_differs_from_the_pipelines_fails_naming_the_field(trainer_site: Site) -> None:
    """Our runtime as applied must hold what the compiled pipeline relies on (RUNTIME_CONTRACT): a field changed by
    hand, or a runtime rendered for other platform settings, fails naming each field; what a run sets itself (its
    /dev/shm size, a TrainJob runtime patch) does not count."""
    site = trainer_site
    ours = trainjob_runtime(site)
    with runtime_applied(site.plane, ours) as replace:
        # The restart budget is the runtime's own (render-runtime --restart-budget): another one is no difference.
        budget = copy.deepcopy(ours)
        budget["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] = 5
        replace(budget)
        runtime = check(site.run(platform=TRAINJOB_PLATFORM), "runtime")
        assert (runtime.status, runtime.reason) == (
            PASS,
            "ClusterTrainingRuntime hyperpod-pretrain matches this pipeline's (restart budget 5)",
        )
        edited = copy.deepcopy(ours)
        del edited["spec"]["template"]["spec"]["failurePolicy"]
        replace(edited)
        result = site.run(platform=TRAINJOB_PLATFORM)
        runtime = check(result, "runtime")
        assert (runtime.status, runtime.reason) == (
            FAIL,
            "ClusterTrainingRuntime hyperpod-pretrain differs from this "
            "pipeline's: template.spec.failurePolicy (JobSet restarts the "
            "group (its maxRestarts, the restart budget, is the runtime's own: "
            'render-runtime --restart-budget)) is "missing", not '
            '"set"',
        )
        assert runtime.fix.startswith("apply deploy/trainjob-runtime.yaml, or what `hyperpod-pretrain render-runtime`")
        others_pass(result, "runtime")

        replace(trainjob_runtime(site, platform=Platform(job_api=TRAINJOB.name, pvc_name="team-fsx")))
        runtime = check(site.run(platform=TRAINJOB_PLATFORM), "runtime")
        # The runtime as the server keeps it (its keys sorted), against the one this pipeline renders.
        assert runtime.status == FAIL and runtime.reason.startswith(
            "ClusterTrainingRuntime hyperpod-pretrain differs from this pipeline's: pod.volumes (the FSx claim) is "
            '[{"name": "fsx-pvc", "persistentVolumeClaim": {"claimName": "team-fsx"}}, '
        ), runtime.reason
        assert "; " not in runtime.reason, "the one field that differs"
        ours_claim = '], not [{"name": "fsx-pvc", "persistentVolumeClaim": {"claimName": "fsx-lustre-pvc"}}, '
        assert ours_claim in runtime.reason

        elsewhere = Platform(
            job_api=TRAINJOB.name,
            pvc_name="team-fsx",
            mount_path="/lustre",
            service_account="trainer",
            automount_service_account_token=True,
        )
        replace(trainjob_runtime(site, storage_root="/lustre", platform=elsewhere))
        runtime = check(site.run(platform=TRAINJOB_PLATFORM), "runtime")
        assert runtime.status == FAIL and runtime.reason.startswith(
            "ClusterTrainingRuntime hyperpod-pretrain differs from this pipeline's: pod.containers[node].volumeMounts "
            '(the FSx and /dev/shm mounts) is [{"mountPath": "/lustre", "name": "fsx-pvc"}'
        ), runtime.reason
        assert (
            '; pod.volumes (the FSx claim) is [{"name": "fsx-pvc", "persistentVolumeClaim": {"claimName": '
            '"team-fsx"}}' in runtime.reason
        )
        assert '; pod.serviceAccountName (the trainer pods\' service account) is "trainer", not null' in runtime.reason
        assert runtime.reason.endswith("; and 1 more"), "three fields named, the fourth counted"

        replace(ours)
        # A run's /dev/shm is its own (the TrainJob patches the runtime's): it does not make the runtime differ.
        result = site.run(platform=TRAINJOB_PLATFORM, job_options={"shm_size": "128Gi"})
        assert check(result, "runtime").status == PASS, check(result, "runtime")
        # So is its grace period, unless Kueue queues the TrainJob: Kueue v0.19.2 drops it at admission (trainjob.py).
        longer = {"grace_period_s": 300}
        assert check(site.run(platform=TRAINJOB_PLATFORM, job_options=longer), "runtime").status == PASS
        queued = Platform(job_api=TRAINJOB.name, queue_name=QUEUE)
        runtime = check(site.run(platform=queued, job_options={"grace_period_s": 300}), "runtime")
        assert (runtime.status, runtime.fix) == (
            FAIL,
            "run with job option grace_period_s=120, or have the platform "
            "team render the runtime with --grace-period-s 300",
        )
        assert runtime.reason.startswith("grace_period_s 300 is not ClusterTrainingRuntime hyperpod-pretrain's 120")

"""The queue check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py): with a Kueue queue compiled in, Kueue's controller, its version and the frameworks its configuration
manages, for either job API; without one, nothing of Kueue's is read."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from components.launch_training.platform import Platform
from components.launch_training.trainjob import TRAINJOB
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS
from tests.cluster.control_plane import audit_time
from tests.cluster.installed import KUEUE_CONFIG, KUEUE_DEFAULT_FRAMEWORKS, KUEUE_NAMESPACE
from tests.preflight_helpers import (
    QUEUE,
    TRAINJOB_PLATFORM,
    Site,
    all_pass,
    check,
    needs_trainer,
    runner_reads,
    runtime_applied,
    statuses,
    trainjob_runtime,
)

# kubernetes-sigs/kueue v0.13.9, config/components/manager/controller_manager_config.yaml: integrations.frameworks
# (no trainjob integration yet: it came in v0.14.0).
KUEUE_0_13_FRAMEWORKS = (
    "batch/job",
    "kubeflow.org/mpijob",
    "ray.io/rayjob",
    "ray.io/raycluster",
    "jobset.x-k8s.io/jobset",
    "kubeflow.org/paddlejob",
    "kubeflow.org/pytorchjob",
    "kubeflow.org/tfjob",
    "kubeflow.org/xgboostjob",
    "kubeflow.org/jaxjob",
    "workload.codeflare.dev/appwrapper",
)

DROPS_GRACE = (
    "it drops a TrainJob's runtime-patch grace period at admission, so a queued TrainJob keeps its "
    "runtime's; the runtime check and the launch refuse another"
)


@pytest.mark.parametrize(
    ("api", "version", "frameworks", "status", "reason"),
    [
        (
            TRAINJOB.name,
            "v0.19.2",
            KUEUE_DEFAULT_FRAMEWORKS,
            PASS,
            f"queue {QUEUE!r}: Kueue v0.19.2, manages trainer.kubeflow.org/trainjob; Kueue is "
            f"built on Trainer v2.2.1's "
            f"API, per its go.mod: {DROPS_GRACE}",
        ),
        (
            TRAINJOB.name,
            "v0.14.0",
            KUEUE_DEFAULT_FRAMEWORKS,
            PASS,
            f"queue {QUEUE!r}: Kueue v0.14.0, manages trainer.kubeflow.org/trainjob; Kueue is "
            f"built on Trainer v2.0.1's "
            f"API, per its go.mod: {DROPS_GRACE}",
        ),
        (
            TRAINJOB.name,
            "v0.20.0",
            KUEUE_DEFAULT_FRAMEWORKS,
            PASS,
            f"queue {QUEUE!r}: Kueue v0.20.0, manages trainer.kubeflow.org/trainjob; Kueue is built on Trainer v2.3's "
            "API (kubernetes-sigs/kueue#14504): a TrainJob's runtime patches are kept",
        ),
        (
            TRAINJOB.name,
            "v0.13.9",
            KUEUE_0_13_FRAMEWORKS,
            FAIL,
            "Kueue v0.13.9 admits no TrainJobs (its trainjob integration came in v0.14.0): "
            "the job would wait suspended "
            "for ever",
        ),
        (
            TRAINJOB.name,
            "v0.19.2",
            tuple(f for f in KUEUE_DEFAULT_FRAMEWORKS if f != "trainer.kubeflow.org/trainjob"),
            FAIL,
            f"Kueue v0.19.2 does not manage trainer.kubeflow.org/trainjob (not in integrations.frameworks of "
            f"{KUEUE_NAMESPACE}/{KUEUE_CONFIG}): the queue label is ignored and the job runs unqueued",
        ),
        (
            TRAINJOB.name,
            None,
            (),
            FAIL,
            f"queue {QUEUE!r} is compiled in, but no Kueue runs in kueue-system (no Deployment labelled "
            "app.kubernetes.io/name=kueue): the job would never be admitted",
        ),
        # The release's own configuration leaves kubeflow.org/pytorchjob commented out; v0.13's listed it.
        (
            "pytorchjob",
            "v0.19.2",
            KUEUE_DEFAULT_FRAMEWORKS,
            FAIL,
            "Kueue v0.19.2 does not manage kubeflow.org/pytorchjob (not in integrations.frameworks of "
            f"{KUEUE_NAMESPACE}/{KUEUE_CONFIG}): the queue label is ignored and the job runs unqueued",
        ),
        (
            "pytorchjob",
            "v0.13.9",
            KUEUE_0_13_FRAMEWORKS,
            PASS,
            f"queue {QUEUE!r}: Kueue v0.13.9, manages kubeflow.org/pytorchjob; Kueue admits a "
            f"PyTorchJob by merge patch, "
            "with Training Operator v1.9.3's types per its go.mod: nothing of the job is dropped",
        ),
    ],
    ids=[
        "trainjob-v0.19.2",
        "trainjob-v0.14.0",
        "trainjob-v0.20.0",
        "trainjob-v0.13.9",
        "trainjob-not-listed",
        "trainjob-no-kueue",
        "pytorchjob-v0.19.2-default-config",
        "pytorchjob-v0.13.9",
    ],
)
def test_the_queue_check_reads_kueues_version_and_frameworks(
    make_site: Callable[..., Site], api: str, version: str | None, frameworks: tuple[str, ...], status: str, reason: str
) -> None:
    """With a Kueue queue compiled in: Kueue's controller in kueue-system (by its label), its image tag's version
    (v0.14.0 or later for a TrainJob) and its configuration's integrations.frameworks naming the job's kind."""
    if api == TRAINJOB.name:
        needs_trainer()
    site = make_site()
    if version is not None:
        site.hp.add_kueue(version, frameworks)
    platform = Platform(job_api=api, queue_name=QUEUE)
    since = audit_time()
    with contextlib.ExitStack() as stack:
        if api == TRAINJOB.name:
            site.hp.add_trainer()
            stack.enter_context(runtime_applied(site.plane, trainjob_runtime(site, platform=platform)))
        result = site.run(platform=platform)
    queue = check(result, "queue")
    assert (queue.status, queue.reason) == (status, reason), queue
    if status == FAIL:
        framework = "trainer.kubeflow.org/trainjob" if api == TRAINJOB.name else "kubeflow.org/pytorchjob"
        assert queue.fix == (
            f"install Kueue v0.14 or later with {framework} in its integrations.frameworks "
            "(kueue-system/kueue-manager-config), or compile without --queue-name"
        )
    assert {n: s for n, s in statuses(result).items() if n != "queue"} == {
        n: s for n, s in all_pass(api=api).items() if n != "queue"
    }, result.markdown()
    reads = runner_reads(site, since)
    assert ("list", "deployments", KUEUE_NAMESPACE, "", 200) in reads
    if version is not None and not reason.startswith("Kueue v0.13.9 admits"):
        assert ("get", "configmaps", KUEUE_NAMESPACE, KUEUE_CONFIG, 200) in reads
    assert not [r for r in reads if r[4] == 403], reads


def test_without_a_queue_the_queue_check_is_not_applicable(trainer_site: Site) -> None:
    trainer_site.hp.add_kueue()  # there, but the pipeline names no queue: nothing of Kueue's is read
    since = audit_time()
    queue = check(trainer_site.run(platform=TRAINJOB_PLATFORM), "queue")
    assert (queue.status, queue.reason) == (
        NOT_APPLICABLE,
        "no Kueue queue compiled in: the job starts when its pods fit",
    )
    assert not {r for r in runner_reads(trainer_site, since) if r[2] == KUEUE_NAMESPACE}

"""What each Kueue release does with the job APIs: since when it admits a kind at all, and which Kubeflow Trainer
API it decodes a TrainJob with (what it drops of a newer Trainer's fields when it writes an admitted TrainJob back).
Read from Kueue's go.mod and controllers at each release tag; the queue check quotes them."""

from __future__ import annotations

from components.launch_training.job_api import JobApi

# The first Kueue release of each integration (in its integrations.frameworks names) that came later than the others:
# the trainjob integration (alpha) is in v0.14.0 and later (kueue#6597).
KUEUE_INTEGRATION_SINCE: dict[str, tuple[int, int, int]] = {"trainer.kubeflow.org/trainjob": (0, 14, 0)}
# The Kubeflow Trainer API each Kueue release is built on (github.com/kubeflow/trainer/v2 in its go.mod, read at every
# tag v0.14.0 to v0.19.2; v0.18.0 and v0.18.1 pin a pseudo-version before v2.2.1). Its TrainJob integration writes an
# admitted or preempted TrainJob back whole with those types (pkg/controller/jobs/trainjob/trainjob_controller.go,
# RunWithPodSetsInfo and Stop: Update), so what a newer Trainer added is dropped. Trainer v2.3.0's types came to
# Kueue's main branch after v0.19.2 (kubernetes-sigs/kueue#14504): a later release is taken to carry them.
KUEUE_TRAINER_API = (
    (0, 14, 0, "v2.0.1"),
    (0, 14, 5, "v2.1.0"),
    (0, 17, 0, "v2.2.0"),
    (0, 18, 0, "v2.2.1"),
    (0, 20, 0, "v2.3.0"),
)
# Its PyTorchJob integration is built on kubeflow/training-operator v1.9.3's types at every one of those tags, and
# admits and stops a job with a merge patch (pkg/util/client Patch, client.MergeFrom): fields it does not know stay.
KUEUE_PYTORCHJOB_NOTE = (
    "admits a PyTorchJob by merge patch, with Training Operator v1.9.3's types per its go.mod: "
    "nothing of the job is dropped"
)


def kueue_trainer_api(version: tuple[int, int, int]) -> str:
    """The Trainer API a Kueue release decodes TrainJobs with ("" before its TrainJob integration)."""
    return next((api for *since, api in reversed(KUEUE_TRAINER_API) if version >= tuple(since)), "")


def kueue_api_note(api: JobApi, version: tuple[int, int, int] | None) -> str:
    """What the Kueue release does to the compiled API's jobs when it admits them, with its source."""
    if not api.kueue_writes_back_whole:
        return KUEUE_PYTORCHJOB_NOTE
    trainer = kueue_trainer_api(version) if version else ""
    if trainer.startswith("v2.3"):
        return "is built on Trainer v2.3's API (kubernetes-sigs/kueue#14504): a TrainJob's runtime patches are kept"
    built = (
        f"is built on Trainer {trainer}'s API, per its go.mod"
        if trainer
        else "of an unknown version may be built on Trainer v2.2's API"
    )
    return (
        f"{built}: it drops a TrainJob's runtime-patch grace period at admission, so a queued TrainJob keeps its "
        "runtime's; the runtime check and the launch refuse another"
    )

from pathlib import Path

from trainer.config import CLUSTER_TRAIN_DEFAULTS

# The compiled pipeline, checked in: what users upload and what run-local executes.
COMPILED_PIPELINE = Path(__file__).resolve().parent.parent / "compiled" / "pretrain_pipeline.yaml"

# The oldest KFP backend that runs the compiled pipeline as written (read from kubeflow/pipelines 2.0.0-2.17.0; there
# are no 2.6-2.13 releases):
# - the exit handler's summary step takes a dsl.PipelineTaskFinalStatus; up to 2.5.0 the upload works but creating a
#   run fails with "task final status not supported yet" (backend/src/v2/compiler/argocompiler/dag.go,
#   addImplicitDependencies; supported from 2.14.0, #11953);
# - the retry policies of stage-data and verify-nccl, tasks inside the exit handler's sub-DAG, are silently ignored
#   before 2.14.0 (argocompiler/container.go, getTaskRetryPolicySpec; #11861).
# Staging's fan-out (a dsl.ParallelFor with a fan-in step after it) needs 2.4.1 (#11627), below that floor; but up to
# 2.16 the exit step's final status stays RUNNING with a loop inside the exit handler (DAG states did not propagate up
# from nested groups until 2.17.0, #13322): the run summary takes its state from the steps' records instead.
MIN_KFP_BACKEND = "2.14.0"
MIN_KFP_BACKEND_WHY = (
    "older backends refuse to create a run whose exit handler takes dsl.PipelineTaskFinalStatus "
    "('task final status not supported yet') and ignore retry policies inside the exit handler"
)

# What a cluster run of the compiled pipeline uses unless a run says otherwise: the pipeline's parameter defaults
# (pipelines/pipeline.py takes them from here) and so `render-job`'s and `preflight`'s, which show and check the job
# a submission would create. The local commands keep the trainer's small CPU defaults (trainer/config.py).
CLUSTER_DEFAULTS: dict[str, int | float | str] = {
    "storage_root": "/fsx",
    "dataset": "corpus",
    "nnodes": 2,
    "max_nodes": 0,
    "nproc_per_node": 8,
    **CLUSTER_TRAIN_DEFAULTS,  # the trainer's settings (trainer/config.py declares each one's cluster default)
    # a finite budget, so that a job whose launcher and exit step were both lost still ends (its operator's deadline
    # follows it); 0 at run time: none
    "timeout_s": 72 * 3600,
    "pending_timeout_s": 1800,
    "recovery_timeout_s": 3600,
    "queue_timeout_s": 0,
    "stall_timeout_s": 0,
    "namespace": "kubeflow",
    "instance_type": "p5.48xlarge",
    # render-job's and preflight's only: the run that names the job, and the trainer image docker/build.sh pushes (a
    # compiled pipeline's trainer_image names its registry and tag)
    "run_id": "example",
    "image": "hyperpod-pretrain-trainer:latest",
}

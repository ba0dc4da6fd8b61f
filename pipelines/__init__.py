from pathlib import Path

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

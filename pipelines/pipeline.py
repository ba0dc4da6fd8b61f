"""The pretraining pipeline: stage_data -> launch_pytorchjob -> verify_nccl -> evaluate_checkpoint.

Storage paths are parameters (kfp.local ignores kfp-kubernetes settings, so a local directory can stand
in for the FSx volume). The defaults describe a cluster run; `hyperpod-pretrain run-local` overrides them.
"""

from pathlib import Path

from kfp import compiler, dsl

from components.evaluate_checkpoint.component import evaluate_checkpoint
from components.launch_pytorchjob.component import launch_pytorchjob
from components.stage_data.component import stage_data
from components.verify_nccl.component import verify_nccl

PIPELINE_NAME = "hyperpod-pretrain"


@dsl.pipeline(name=PIPELINE_NAME, description="Pretrain a causal LM with PyTorch DDP on SageMaker HyperPod (EKS).")
def pretrain_pipeline(
    source: str,
    storage_root: str = "/fsx",
    dataset: str = "corpus",
    include: list = ["*"],  # noqa: B006 - KFP reads the default from the signature
    exclude: list = ["__pycache__/*", "*.pyc", ".*"],  # noqa: B006
    vocab_size: int = 8192,
    val_fraction: float = 0.01,
    tokenizer_path: str = "",
    s3_endpoint_url: str = "",
    staging_workers: int = 16,
    staging_chunk_size_mb: int = 8,
    keep_deleted: bool = False,
    run_id: str = "",
    backend: str = "kubernetes",
    nnodes: int = 2,
    max_nodes: int = 0,
    nproc_per_node: int = 8,
    preset: str = "gpt2-124m",
    max_steps: int = 5000,
    seed: int = 1234,
    batch_size: int = 16,
    seq_len: int = 1024,
    lr: float = 6e-4,
    warmup_steps: int = 200,
    checkpoint_every: int = 500,
    log_every: int = 10,
    train_timeout_s: int = 0,
    trainer_image: str = "",
    namespace: str = "kubeflow",
    instance_type: str = "p5.48xlarge",
    job_options: dict = {},  # noqa: B006 - any other manifest setting (components/launch_pytorchjob/manifest.py)
    stream_logs: str = "worker-0",
    owner_reference: bool = True,
    expect_transport: str = "",
    bandwidth_fails: bool = False,
    eval_max_tokens: int = 1048576,
    max_val_loss: float = 0.0,
    baseline_run_id: str = "",
    baseline_margin: float = 0.0,
    gate_warn_only: bool = False,
    export_s3_uri: str = "",
):
    staged = stage_data(
        source=source,
        storage_root=storage_root,
        dataset=dataset,
        include=include,
        exclude=exclude,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        tokenizer_path=tokenizer_path,
        endpoint_url=s3_endpoint_url,
        workers=staging_workers,
        chunk_size_mb=staging_chunk_size_mb,
        keep_deleted=keep_deleted,
    )
    trained = launch_pytorchjob(
        storage_root=storage_root,
        dataset=dataset,
        run_id=run_id,
        pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        backend=backend,
        nnodes=nnodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node,
        preset=preset,
        max_steps=max_steps,
        seed=seed,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
        warmup_steps=warmup_steps,
        checkpoint_every=checkpoint_every,
        log_every=log_every,
        timeout_s=train_timeout_s,
        image=trainer_image,
        namespace=namespace,
        instance_type=instance_type,
        job_options=job_options,
        stream_logs=stream_logs,
        owner_reference=owner_reference,
    ).after(staged)
    verified = verify_nccl(
        storage_root=storage_root,
        run_id=trained.outputs["run_id"],
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        instance_type=instance_type,
        expect_transport=expect_transport,
        bandwidth_fails=bandwidth_fails,
        job_name=trained.outputs["job_name"],
        namespace=trained.outputs["namespace"],
    )
    evaluate_checkpoint(
        storage_root=storage_root,
        dataset=dataset,
        run_id=trained.outputs["run_id"],
        max_tokens=eval_max_tokens,
        checkpoint="latest",
        max_val_loss=max_val_loss,
        baseline_run_id=baseline_run_id,
        baseline_margin=baseline_margin,
        gate_warn_only=gate_warn_only,
        export_s3_uri=export_s3_uri,
        s3_endpoint_url=s3_endpoint_url,
    ).after(verified)


def compile_pipeline(output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pretrain_pipeline, str(output))

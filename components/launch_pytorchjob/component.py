"""KFP wrapper of the launcher (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def launch_pytorchjob(
    storage_root: str,
    dataset: str,
    run_id: str,
    pipeline_run_id: str,
    backend: str,
    nnodes: int,
    nproc_per_node: int,
    preset: str,
    max_steps: int,
    seed: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    warmup_steps: int,
    checkpoint_every: int,
    log_every: int,
    timeout_s: int,
) -> str:
    """Train with torchrun (locally or as a PyTorchJob); returns the run id, which names <root>/runs/<run_id>."""
    from components.kfp_support import setup_logging
    from components.launch_pytorchjob.core import LaunchConfig, launch

    setup_logging()
    result = launch(
        LaunchConfig(
            storage_root=storage_root,
            dataset=dataset,
            run_id=run_id or pipeline_run_id,
            backend=backend,
            nnodes=nnodes,
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
            timeout_s=timeout_s,
        )
    )
    return result.run_id

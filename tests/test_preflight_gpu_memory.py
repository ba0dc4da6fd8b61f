"""The gpu-memory check (it reads the manifest only: no cluster), and the published model's config.json it and
the checkpoint-throughput check size the model from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.errors import InputError
from components.launch_training.manifest import render_job
from components.preflight.checkpoint_throughput import checkpoint_need
from components.preflight.context import Context
from components.preflight.core import published_config
from components.preflight.gpu_memory import check_gpu_memory
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, WARN
from tests.preflight_helpers import config


def gpu_memory(**overrides: Any) -> Any:
    cfg = config(**overrides)
    return check_gpu_memory(Context(render_job(cfg.job_spec()), None, None, 2048, cfg.instance_type))


def test_gpu_memory_refuses_llama_8b_under_ddp_on_p5_naming_what_fits_and_passes_it_under_hsdp() -> None:
    """16 bytes a parameter on every GPU (weights, gradients, AdamW) is 105 GiB at 7.05B before an activation: no p5
    GPU holds it. Sharded over a node's 8 GPUs under hsdp, with two nodes and selective checkpointing, it fits."""
    refused = gpu_memory(preset="llama-8b", nnodes=1, batch_size=2, seq_len=4096)
    assert refused.status == FAIL
    assert refused.reason.startswith(
        "llama-8b (7.05B parameters at vocabulary 8,192, assumed) under ddp on 1 node(s) x 8 GPUs, micro-batch 2 x "
        "4096 tokens, activation checkpointing none: 184.9 GiB per GPU (weights 26.3, gradients 26.3, optimizer 52.5"
    )
    assert refused.reason.endswith("more than the 80 GiB of a ml.p5.48xlarge GPU can hold (72 GiB usable)")
    assert refused.fix.startswith(
        "it would fit with job option parallelism=fsdp (70.4 GiB); or parallelism=fsdp and "
        "activation_checkpointing=selective (45.7 GiB)"
    )
    fits = gpu_memory(
        preset="llama-8b",
        nnodes=2,
        batch_size=2,
        seq_len=4096,
        job_options={"parallelism": "hsdp", "activation_checkpointing": "selective"},
    )
    assert fits.status == PASS and "under hsdp on 2 node(s)" in fits.reason and "45.7 GiB per GPU" in fits.reason
    roomy = gpu_memory(
        preset="llama-8b",
        nnodes=1,
        batch_size=2,
        seq_len=4096,
        instance_type="p5en.48xlarge",
        job_options={"parallelism": "fsdp"},
    )
    assert roomy.status == PASS and roomy.reason.endswith("of the 141 GiB of a p5en.48xlarge GPU")


def test_gpu_memory_reads_gradient_accumulation_and_refuses_llama_8b_where_it_would_not_fit() -> None:
    """llama-8b on 2 x 8 p5 under hsdp, micro-batch 2 x 8,192, 4 micro-batches a step, no checkpointing: the
    activations alone are 98.6 GiB. Accumulation is read and said to add nothing (gradients stay sharded between
    micro-batches, tests/test_parallel.py); full checkpointing or micro-batch 1 would fit."""
    refused = gpu_memory(
        preset="llama-8b",
        nnodes=2,
        batch_size=2,
        seq_len=8192,
        job_options={"parallelism": "hsdp", "grad_accum_steps": 4},
    )
    assert refused.status == FAIL
    assert (
        "micro-batch 2 x 8192 tokens, 4 micro-batches a step (no more memory: gradients stay sharded between "
        "them), activation checkpointing none: 124.7 GiB per GPU"
    ) in refused.reason
    assert "activations 98.6" in refused.reason and refused.reason.endswith("(72 GiB usable)")
    assert refused.fix.startswith(
        "it would fit with parallelism=hsdp and activation_checkpointing=full (24.6 GiB); "
        "or batch_size 1 (raise grad_accum_steps to keep the global batch) (70.4 GiB)"
    )
    once = gpu_memory(preset="llama-8b", nnodes=2, batch_size=2, seq_len=8192, job_options={"parallelism": "hsdp"})
    assert once.status == FAIL and "124.7 GiB per GPU" in once.reason  # the same estimate without accumulation


def test_gpu_memory_warns_when_tight_and_says_when_the_gpu_is_unknown() -> None:
    tight = gpu_memory(preset="llama-8b", nnodes=2, batch_size=8, seq_len=1024, job_options={"parallelism": "hsdp"})
    assert tight.status == WARN and tight.fix.startswith("if it runs out of memory: it would fit with")
    unknown = gpu_memory(
        preset="llama-1b", instance_type="trn1.32xlarge", job_options={"gpus_per_node": 8, "efa_per_node": 8}
    )
    assert unknown.status == NOT_APPLICABLE and "the GPU memory of trn1.32xlarge is unknown" in unknown.reason


# Llama 3.1 8B's config.json (meta-llama/Llama-3.1-8B, as published: its sizes, vocabulary, rope scaling, dtype).
LLAMA_31_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "dtype": "bfloat16",
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def test_gpu_memory_and_the_checkpoint_of_a_published_model_come_from_its_config_json(
    s3_endpoint: str, aws_env: None, tmp_path: Path
) -> None:
    """Llama 3.1 8B in S3, not copied yet: its config.json alone is read (8.03B parameters at its own vocabulary of
    128,256, not a preset's at the staged one); the job trains it from where staging will copy it."""
    import boto3
    from transformers import LlamaConfig

    LlamaConfig(**LLAMA_31_8B).save_pretrained(tmp_path / "llama")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="published")
    s3.upload_file(str(tmp_path / "llama" / "config.json"), "published", "meta-llama/Llama-3.1-8B/config.json")
    cfg = config(
        init_from_model="s3://published/meta-llama/Llama-3.1-8B",
        s3_endpoint_url=s3_endpoint,
        nnodes=2,
        batch_size=2,
        seq_len=4096,
        job_options={"parallelism": "hsdp", "activation_checkpointing": "selective"},
    )
    model = published_config(cfg)
    assert isinstance(model, dict) and model["vocab_size"] == 128256
    args = cfg.trainer_args()
    assert cfg.model_dir.startswith("/fsx/models/Llama-3.1-8B-") and "--preset" not in args
    assert args[args.index("--init-from-model") + 1] == cfg.model_dir
    ctx = Context(render_job(cfg.job_spec()), None, None, 2048, cfg.instance_type, model=model)
    fits = check_gpu_memory(ctx)
    assert fits.reason.startswith(
        "the published llama model (8.03B parameters at vocabulary 128,256) under hsdp on 2 node(s) x 8 GPUs"
    ), fits.reason
    assert checkpoint_need(ctx).describe().startswith("the published llama model checkpoint, 8,030,261,248 parameters")
    missing = published_config(config(init_from_model="s3://published/gone", s3_endpoint_url=s3_endpoint))
    assert isinstance(missing, str) and missing.startswith("init_from_model s3://published/gone: config.json not read")
    with pytest.raises(ValueError, match="config.json not read"):
        Context(render_job(cfg.job_spec()), None, None, 2048, cfg.instance_type, model=missing).model_config(4096)
    with pytest.raises(
        InputError,
        match=r"^init_from_model '/home/me/llama' is outside the FSx mount path '/fsx', "
        "where the training job's pods see the volume",
    ):
        config(init_from_model="/home/me/llama").validate(check_storage=False)

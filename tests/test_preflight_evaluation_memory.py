"""The evaluation-memory check (it reads the manifest and the compiled evaluation resources only: no cluster): the
evaluate step's need for the run's model on a GPU of the training nodes, or on the CPU, against its pod."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest

from common.errors import InputError
from components.evaluate_checkpoint.resources import EvaluationResources
from components.launch_training.manifest import render_job
from components.preflight.context import Context
from components.preflight.evaluation_memory import EVAL_BATCH_SIZE, check_evaluation_memory, evaluation_need
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, WARN
from tests.helpers import run_cli
from tests.preflight_helpers import config
from tests.test_preflight_gpu_memory import LLAMA_31_8B
from trainer.memory import model_shape
from trainer.model import config_from_dict

ON_CPU = EvaluationResources(gpus=0, cpu="8", memory="32Gi")
# Llama 3.1's published configs (config.json, model_type included), 8B and 70B.
LLAMA_8B = {**LLAMA_31_8B, "model_type": "llama"}
LLAMA_70B = {
    **LLAMA_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}


def evaluation_memory(
    model: dict[str, Any] | None = None, evaluation: EvaluationResources | None = None, **overrides: Any
) -> Any:
    cfg = config(**overrides)
    job = render_job(cfg.job_spec())
    return check_evaluation_memory(
        Context(job, None, None, 2048, cfg.instance_type, model=model, evaluation=evaluation)
    )


def test_llama_8b_passes_on_one_p5_gpu_in_bf16_with_the_default_pod() -> None:
    """The default compile: one GPU and 32Gi. llama-8b in bf16 is 13.1 GiB; with the val batch (8 x 4,096 tokens),
    a logits chunk and the allocator's reserve, 23.0 GiB of an 80 GiB H100; the host holds the process and the
    largest checkpoint piece (the embedding, read in fp32 and converted to bf16 on the way)."""
    fits = evaluation_memory(preset="llama-8b", seq_len=4096)
    assert fits.status == PASS
    assert fits.reason == (
        "evaluate-checkpoint on 1 GPU of a ml.p5.48xlarge: llama-8b (7.05B parameters at vocabulary 8,192, assumed) "
        "in bf16, batch 8 x 4096 tokens: 23.0 GiB (weights 13.1, val batch 7.1, logits 0.6, allocator reserve 2.1) "
        "of a 80 GiB GPU and 3.5 GiB of its 32Gi memory limit (process 3.0, the largest checkpoint piece 0.5)"
    )


def test_a_model_no_gpu_of_the_instance_holds_fails_naming_the_cpu_compile_and_a_larger_gpu() -> None:
    """Llama 3.1 70B: 131.4 GiB of bf16 weights alone, more than an H100 holds. One line: the step, the need, the
    limit; the fix: compile the evaluation onto the CPU with the memory its fp32 model needs, or an instance type
    whose GPU holds it."""
    refused = evaluation_memory(model=LLAMA_70B, seq_len=4096, nnodes=4, job_options={"parallelism": "hsdp"})
    assert refused.status == FAIL and "\n" not in refused.reason
    assert refused.reason == (
        "evaluate-checkpoint on 1 GPU of a ml.p5.48xlarge: the published llama model (70.55B parameters at vocabulary "
        "128,256) in bf16, batch 8 x 4096 tokens: needs 160.8 GiB (weights 131.4, val batch 14.1, logits 0.6, "
        "allocator reserve 14.6) of one GPU, more than a ml.p5.48xlarge GPU's 80 GiB can hold (72 GiB usable)"
    )
    assert refused.fix == (
        "compile with --evaluation-gpus 0 --evaluation-memory 301Gi (fp32 on the CPU, slower), or train on "
        "p6-b200.48xlarge (180 GiB GPUs)"
    )


def test_the_cpu_compile_needs_the_fp32_model_in_its_memory_limit() -> None:
    """--evaluation-gpus 0 with the default 32Gi: llama-8b in fp32 is 26.3 GiB of weights, and with the val batch in
    fp32 the limit is short; the fix names the memory that holds it, or a GPU, which would."""
    refused = evaluation_memory(preset="llama-8b", seq_len=4096, evaluation=ON_CPU)
    assert refused.status == FAIL
    assert refused.reason == (
        "evaluate-checkpoint on the CPU: llama-8b (7.05B parameters at vocabulary 8,192, assumed) in fp32, batch 8 x "
        "4096 tokens: needs 42.6 GiB of its 32Gi memory limit (weights 26.3, val batch 14.3, logits 0.6, process 1.0, "
        "the largest checkpoint piece 0.4), more than the limit"
    )
    assert refused.fix == (
        "compile with --evaluation-memory 43Gi or with --evaluation-gpus 1 (bf16 on a GPU of the training nodes)"
    )
    fits = evaluation_memory(preset="llama-8b", seq_len=4096, evaluation=EvaluationResources(0, "16", "43Gi"))
    assert fits.status == PASS and fits.reason.endswith(
        "42.6 GiB of its 43Gi memory limit (weights 26.3, val batch 14.3, logits 0.6, process 1.0, the largest "
        "checkpoint piece 0.4)"
    )


def test_on_a_gpu_the_host_still_holds_the_process_and_the_largest_checkpoint_piece() -> None:
    """Llama 3.1 8B's embedding (128,256 x 4,096) is its largest tensor: read in fp32, made a tensor and converted to
    bf16 on the CPU on its way to the GPU, 4.9 GiB; with the process, more than a 6Gi pod holds."""
    refused = evaluation_memory(model=LLAMA_8B, seq_len=4096, evaluation=EvaluationResources(1, "8", "6Gi"))
    assert refused.status == FAIL
    assert refused.reason.endswith(
        "needs 7.9 GiB of its 6Gi memory limit (process 3.0, the largest checkpoint piece 4.9), more than the limit"
    )
    assert refused.fix == "compile with --evaluation-memory 8Gi"
    shape = model_shape(config_from_dict(dict(LLAMA_8B)))
    assert shape.largest_tensor == 128256 * 4096
    assert evaluation_need(shape, 4096, on_gpu=True).piece == 10 * 128256 * 4096


def test_a_tight_gpu_warns_and_an_unknown_one_is_not_applicable() -> None:
    """Llama 3.1 8B with 8 x 8,192-token val batches on an A100 40 GB: 32.8 GiB, past 80% of it."""
    tight = evaluation_memory(model=LLAMA_8B, seq_len=8192, instance_type="p4d.24xlarge")
    assert tight.status == WARN and tight.reason.endswith(": tight (over 80% of the GPU)")
    assert tight.fix == (
        "if it runs out of memory: compile with --evaluation-gpus 0 --evaluation-memory 64Gi (fp32 on the CPU, slower)"
    )
    unknown = evaluation_memory(
        preset="llama-1b", instance_type="trn1.32xlarge", job_options={"gpus_per_node": 8, "efa_per_node": 8}
    )
    assert unknown.status == NOT_APPLICABLE and "the GPU memory of trn1.32xlarge is unknown" in unknown.reason


def test_the_evaluation_batch_is_the_evaluation_step_s() -> None:
    from components.evaluate_checkpoint.core import evaluate_checkpoint

    assert inspect.signature(evaluate_checkpoint).parameters["batch_size"].default == EVAL_BATCH_SIZE


def test_the_resources_are_checked_once_and_read_back_from_the_compiled_constant() -> None:
    assert EvaluationResources.from_dict({"gpus": 1.0, "cpu": "8", "memory": "32Gi"}) == EvaluationResources()
    for values, message in (
        ({"gpus": 2}, "--evaluation-gpus 2: 1 (the evaluation loads the model on one GPU) or 0 (on the CPU)"),
        ({"cpu": "eight"}, "--evaluation-cpu 'eight': CPUs as Kubernetes writes them"),
        ({"memory": "1.5Gi"}, "--evaluation-memory '1.5Gi': a whole amount with its unit"),
        ({"gpu": 1}, "evaluation setting(s) 'gpu' unknown: gpus, cpu, memory"),
    ):
        with pytest.raises(InputError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            EvaluationResources.from_dict(values)


def test_preflight_of_a_pipeline_file_checks_the_evaluation_it_was_compiled_with(tmp_path: Path) -> None:
    """`preflight --pipeline-file` holds the model to the evaluation resources compiled into the file (its preflight
    step's constant); from flags, to the default compile's."""
    from pipelines.cli import build_parser
    from pipelines.cli.job import preflight_settings

    compiled = tmp_path / "cpu.yaml"
    result = run_cli("compile", "--output", str(compiled), "--evaluation-gpus", "0", "--evaluation-memory", "96Gi")
    assert result.returncode == 0, result.stderr
    package = ["preflight", "--pipeline-file", str(compiled), "--param", "trainer_image=registry.example/t:1"]
    assert preflight_settings(build_parser().parse_args(package))[2] == EvaluationResources(0, "8", "96Gi")
    assert preflight_settings(build_parser().parse_args(["preflight"]))[2] is None
    assert evaluation_memory(preset="llama-8b", seq_len=4096, evaluation=None).reason.startswith(
        "evaluate-checkpoint on 1 GPU of a ml.p5.48xlarge"
    )

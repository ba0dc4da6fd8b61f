"""Rank 0's console lines (trainer/metrics.py) as pure functions: units, durations, the step line, the plan line, the
ETA's clock. (tests/test_trainer.py reads the lines a real run logged.)"""

import pytest
import torch

from trainer.metrics import (
    NO_VALUE,
    StepTimes,
    flops_per_token,
    human_count,
    human_duration,
    peak_flops,
    plan_line,
    short_float,
    step_line,
)
from trainer.model import build_model, model_config


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (950, "950"),
        (999.4, "999"),
        (999.96, "1.0k"),
        (7_100, "7.1k"),
        (12_345, "12.3k"),
        (99_960, "100k"),
        (364_000, "364k"),
        (999_999, "1.0M"),
        (1_600_000, "1.6M"),
        (12_345_678, "12.3M"),
        (124_000_000, "124M"),
        (2.1e9, "2.1B"),
        (3.4e12, "3.4T"),
    ],
)
def test_counts_take_k_m_b_units_with_three_figures_at_most(value: float, text: str) -> None:
    assert human_count(value) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.4, "0s"),
        (45, "45s"),
        (59.6, "1m00s"),
        (80, "1m20s"),
        (3599, "59m59s"),
        (3720, "1h02m"),
        (86_399, "23h59m"),
        (90_000, "1d01h"),
        (None, NO_VALUE),
        (float("inf"), NO_VALUE),
    ],
)
def test_durations_read_as_people_write_them(seconds: float | None, text: str) -> None:
    assert human_duration(seconds) == text


def test_a_learning_rate_has_no_padded_exponent() -> None:
    assert [short_float(v) for v in (2.9e-3, 6e-4, 5e-5, 1.0)] == ["2.9e-3", "6.0e-4", "5.0e-5", "1.0e0"]


def test_the_step_line_has_every_field_two_spaces_apart() -> None:
    line = step_line(40, 200, 4.21133, 2.94e-3, 0.8312, 7_130.0, None, 80.2)
    assert line == "step 40/200  loss 4.2113  lr 2.9e-3  gnorm 0.83  tok/s 7.1k  mfu —  eta 1m20s"
    on_a_gpu = step_line(5000, 5000, 2.5, 6e-5, 0.31, 1.23e6, 0.4123, 0.0)
    assert on_a_gpu == "step 5000/5000  loss 2.5000  lr 6.0e-5  gnorm 0.31  tok/s 1.2M  mfu 41.2%  eta 0s"
    assert step_line(1, 10, 5.0, 1e-3, 1.0, 10.0, None, None).endswith("eta —")


def test_the_plan_line_says_size_tokens_and_epochs() -> None:
    assert plan_line(12_345_678, 8_192, 200, 364_000) == (
        "model 12.3M params; 8,192 tokens per step x 200 steps = 1.6M tokens, 4.5 epochs of the train split "
        "(364k tokens)"
    )
    assert "= 81.9M tokens, 0.0051 epochs of the train split (16.0B tokens)" in plan_line(124e6, 16_384, 5_000, 16e9)
    assert "= 61.4k tokens, 17 epochs" in plan_line(100_000, 1_024, 60, 3_600)


def test_the_eta_is_the_mean_step_time_of_the_recent_windows_without_the_first_step() -> None:
    times = StepTimes(windows=2)
    times.mark(1, 100.0)  # the end of the first step, which took long (compile): not counted
    assert times.seconds_per_step() is None and times.eta_s(1, 100) is None
    times.mark(10, 109.0)  # 1 s a step
    assert times.eta_s(10, 100) == pytest.approx(90.0)
    times.mark(20, 129.0)  # 2 s a step: the mean over both windows, 29 s for 19 steps
    assert times.seconds_per_step() == pytest.approx(29 / 19)
    times.mark(30, 159.0)  # 3 s a step; the first window (steps 1-10) falls out of the last two
    assert times.seconds_per_step() == pytest.approx(2.5) and times.eta_s(30, 30) == 0.0
    times.mark(30, 170.0)  # the same step again (a forced log row after a checkpoint): not a new window
    assert times.seconds_per_step() == pytest.approx(2.5)


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_counts_the_matmul_weights_only(tied: bool) -> None:
    """6 per matmul weight: a tied token embedding once (it is the output projection), an untied one not at all (a
    lookup), position embeddings never; plus 12 * layers * width * seq for attention."""
    config = model_config("tiny", vocab_size=96, max_seq_len=32, eos_token_id=0)
    config.tie_word_embeddings = tied
    model = build_model(config)
    embedding = model.get_input_embeddings().weight.numel()
    every = sum(p.numel() for p in model.parameters())  # a tied weight once; position embeddings included
    positions = model.transformer.wpe.weight.numel()
    matmul = every - positions - (0 if tied else embedding)
    assert flops_per_token(model, 32) == 6 * matmul + 12 * config.n_layer * config.n_embd * 32


def torchtitan_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """torchtitan's models/utils.py get_dense_model_nparams_and_flops, written from its formula: 6 x (parameters -
    the embedding modules' parameters) + 6 x layers x heads x (q/k plus v head dims) x seq_len."""
    config = model.config
    parameters = sum(p.numel() for p in model.parameters())
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 6 * (parameters - embeddings) + 6 * config.num_hidden_layers * heads * (2 * head_dim) * seq_len


def llama_with_its_own_head_dim() -> object:
    """A published-Llama shape whose heads are not the width: hidden 2048, 32 heads x 128 (before: -21.7% FLOPs)."""
    from transformers import LlamaConfig

    shape = {"hidden_size": 2048, "num_attention_heads": 32, "head_dim": 128, "num_key_value_heads": 8}
    return LlamaConfig(vocab_size=128256, num_hidden_layers=16, intermediate_size=8192, **shape)


@pytest.mark.parametrize("preset", ["tiny", "gpt2-124m", "gpt2-350m", "llama-1b", "llama-3b", "llama-8b", "head_dim"])
def test_flops_per_token_are_torchtitans(preset: str) -> None:
    """Untied (torchtitan's models are), at 8,192 tokens: our count equals torchtitan's within 0.5%."""
    if preset == "head_dim":
        config = llama_with_its_own_head_dim()
    else:
        config = model_config(preset, vocab_size=128256, max_seq_len=8192, eos_token_id=0)
    config.tie_word_embeddings = False
    with torch.device("meta"):
        model = build_model(config)
    ours, theirs = flops_per_token(model, 8192), torchtitan_flops_per_token(model, 8192)
    assert abs(ours - theirs) <= 0.005 * theirs, f"{preset}: {ours:.4g} against torchtitan's {theirs:.4g}"


def test_a_gpu_peak_is_looked_up_by_its_exact_name_and_an_unknown_gpu_gets_no_mfu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = torch.device("cuda", 0)
    for name, peak in [
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA B200", 2250e12),
        ("NVIDIA H100 SXM5 94GB", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(gpu, 0.0) == peak, name
    assert "no MFU: no peak FLOP/s known for 'NVIDIA H100 SXM5 94GB'" in caplog.text
    assert peak_flops(gpu, 500.0) == 500e12 and peak_flops(torch.device("cpu"), 0.0) is None

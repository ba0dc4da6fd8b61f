"""Test helpers: a synthetic corpus with learnable structure, and a small launch configuration."""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch

from components.launch_training.config import LaunchConfig
from trainer.layout import DatasetPaths, RunPaths

NOUNS = ["cluster", "node", "pod", "volume", "checkpoint", "gradient", "tensor", "rank", "shard", "model"]
VERBS = ["saves", "loads", "reduces", "streams", "trains", "restores", "verifies", "schedules"]
ADJECTIVES = ["large", "healthy", "elastic", "shared", "fast", "warm", "idle", "stale"]


def write_corpus(directory: Path, files: int = 12, sentences: int = 120, seed: int = 0) -> Path:
    """Documents of a tiny grammar: a model that learns it predicts far better than chance."""
    rng = random.Random(seed)
    for i in range(files):
        lines = []
        for _ in range(sentences):
            a, b = rng.choice(NOUNS), rng.choice(NOUNS)
            lines.append(f"the {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {b}.")
        sub = directory / ("part-a" if i % 2 else "part-b")
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc {i:02d}.txt").write_text("\n".join(lines) + "\n")
    return directory


# A run every step of which is logged: the runs that compare losses step by step.
EXACT = dict(max_steps=40, log_every=1, checkpoint_every=10)
# The mixture of the conftest's mixed_root: its three datasets, each far from its share in size.
MIXTURE = [
    {"dataset": "synthetic", "weight": 0.6},
    {"dataset": "code", "weight": 0.3},
    {"dataset": "math", "weight": 0.1},
]
# With dropout: its masks draw from each rank's RNG, which a resume must restore too.
MIXED_RUN = dict(dataset="synthetic", mixture=MIXTURE, max_steps=20, log_every=1, checkpoint_every=5, dropout=0.1)


# `render-job` of a 2-node, 8-GPU run as a person types it (tests/test_manifest.py, tests/test_trainjob.py).
RENDER_JOB = [
    sys.executable,
    "-m",
    "pipelines.cli",
    "render-job",
    "--storage-root",
    "/fsx",
    "--dataset",
    "corpus",
    "--run-id",
    "r1",
    "--image",
    "img:1",
    "--nnodes",
    "2",
    "--nproc-per-node",
    "8",
]


def tiny_launch(root: Path, run_id: str, **overrides) -> LaunchConfig:
    settings = dict(
        storage_root=str(root),
        dataset="synthetic",
        run_id=run_id,
        nproc_per_node=2,
        preset="tiny",
        max_steps=60,
        batch_size=8,
        seq_len=64,
        lr=5e-3,
        warmup_steps=5,
        checkpoint_every=20,
        log_every=10,
        timeout_s=300,
    )
    settings.update(overrides)
    return LaunchConfig.of(**settings)


def snapshot_dir(root: Path, dataset: str) -> Path:
    """The dataset's current snapshot (staging's output), which the tests read as the trainer does."""
    directory = DatasetPaths.of(root, dataset).current_snapshot()
    assert directory is not None, f"dataset {dataset} is not staged under {root}"
    return directory


def write_single_file_checkpoint(directory: Path, state: dict) -> Path:
    """`state` as the trainer saved it before sharded checkpoints: one torch.save file per step, a hard link
    checkpoint_latest.pt to it, and index.json with its size (trainer/checkpoint.py at 9d2ef2b, _commit)."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"checkpoint_step_{state['step']:08d}.pt"
    torch.save(state, path)
    (directory / "checkpoint_latest.pt").unlink(missing_ok=True)
    os.link(path, directory / "checkpoint_latest.pt")
    entry = {"file": path.name, "step": state["step"], "size": path.stat().st_size, "time": 0.0}
    (directory / "index.json").write_text(json.dumps({"checkpoints": [entry], "latest": entry}))
    return path


ENCODE_SLOWLY = """
import sys
import components.stage_data.tokenization.encode as t
from trainer.layout import DatasetPaths
t.JOURNAL_EVERY_S = 0.0  # journal every part done (a file, a Parquet row group)
t.BATCH_BYTES = 4096  # encode a few documents at a time, not all in one batch
t.encode_group(DatasetPaths.of(sys.argv[1], sys.argv[2]), sys.argv[3], 0)
"""


def encode_until_killed(root: Path, dataset: str, snapshot: str, journal: Path, lines: int) -> None:
    """Encode group 0 of a planned snapshot in a process of its own, SIGKILLed once its journal has `lines` lines."""
    group = subprocess.Popen(
        [sys.executable, "-c", ENCODE_SLOWLY, str(root), dataset, snapshot], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and group.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= lines:
            break
        time.sleep(0.005)
    group.send_signal(signal.SIGKILL)
    _, stderr = group.communicate()
    assert group.returncode == -signal.SIGKILL, f"the group ended before it was killed: {stderr[-2000:]}"


PUBLISHED_VOCAB = 384  # the published test models' vocabulary


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def save_llama(path: Path) -> torch.nn.Module:
    """A small Llama (untied) as a published model as Llama 3's are: in bfloat16, with Llama 3's rope scaling,
    save_pretrained in several safetensors shards. Returned in fp32 (the same values): the trainer's dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=160,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=PUBLISHED_VOCAB,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            rope_scaling=dict(LLAMA3_ROPE),
        )
    )
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")  # several shards and an index
    return model.float().eval()


def save_gpt2(path: Path) -> torch.nn.Module:
    """A small GPT-2 (tied) as a published model, in one safetensors file."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=PUBLISHED_VOCAB, n_positions=128, bos_token_id=0, eos_token_id=0
        )
    )
    model.save_pretrained(path)
    return model.eval()


def save_gpt2_as_the_hub_serves_it(path: Path) -> torch.nn.Module:
    """A small GPT-2 in the layout of the Hub's openai-community/gpt2 files: the base model's keys (`h.0.*`, `wte.*`,
    `ln_f.*`, no `transformer.` prefix), no `lm_head` (tied), and the old causal masks `h.N.attn.bias` beside them.
    Returned as transformers loads that directory (from_pretrained), which a test compares with the original."""
    from safetensors.torch import save_file
    from transformers import GPT2LMHeadModel

    original = save_gpt2(path)
    (path / "model.safetensors").unlink()
    tensors = {key: value.contiguous() for key, value in original.transformer.state_dict().items()}
    masks = torch.tril(torch.ones(128, 128)).view(1, 1, 128, 128)
    tensors |= {f"h.{i}.attn.bias": masks.clone() for i in range(original.config.n_layer)}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    loaded = GPT2LMHeadModel.from_pretrained(path).eval()
    assert all(torch.equal(p, loaded.state_dict()[k]) for k, p in original.state_dict().items()), "transformers' load"
    return loaded


def save_llama_without_its_prefix(path: Path) -> torch.nn.Module:
    """save_llama's model (untied, in bf16 shards with their index) whose files name the base model's weights without
    `model.` (`layers.0.*`, `embed_tokens.*`) beside `lm_head.weight`, as some conversion scripts write them. Returned
    as transformers loads that directory (whole: from_pretrained takes either naming)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    original = save_llama(path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(path / shard, "pt") as f:
            tensors = {key.removeprefix("model."): f.get_tensor(key) for key in f.keys()}
        save_file(tensors, path / shard, metadata={"format": "pt"})
    index["weight_map"] = {key.removeprefix("model."): shard for key, shard in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    loaded = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert all(torch.equal(p, loaded.state_dict()[k]) for k, p in original.state_dict().items()), "transformers' load"
    return loaded


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """A read-only session fixture's directory, built by whichever pytest-xdist worker asks first and read by the
    others: under `-n 2` each worker has its own session, and a training run built twice is CPU the suite pays twice
    (pytest-xdist's docs, "Making session-scoped fixtures execute only once"). `build` fills the directory; a build
    that failed is started again by the next asker."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory, built = shared / name, shared / f"{name}.built"
    with FileLock(shared / f"{name}.lock"):
        if not built.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            built.touch()
    return directory


def trained(staged: Path, run_id: str, **settings: object) -> Callable[[Path], None]:
    """A build for built_once: a copy of a staged storage root and a run trained on it."""

    def build(root: Path) -> None:
        from components.launch_training.core import launch

        shutil.copytree(staged, root, dirs_exist_ok=True)
        launch(tiny_launch(root, run_id, **settings))

    return build


def rewound_copy(run: RunPaths, root: Path, name: str, step: int) -> RunPaths:
    """A copy of `run` as it was when `step` was its newest checkpoint: a run to resume from a shared, read-only
    one, without training its first steps again."""
    from trainer.checkpoint import LATEST, step_dir_name

    copy = RunPaths.of(root, name)
    shutil.copytree(run.root, copy.root, symlinks=True)
    for later in copy.checkpoints.glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (copy.checkpoints / LATEST).unlink()
    (copy.checkpoints / LATEST).symlink_to(step_dir_name(step))
    for samples in copy.logs.glob("samples_rank_*.txt"):  # --log-samples' lines ("<step> <micro> <windows>")
        lines = samples.read_text().splitlines(keepends=True)
        samples.write_text("".join(line for line in lines if int(line.split()[0]) <= step))
    return copy


def run_probe(module: str, *args: str, env: dict[str, str] | None = None) -> None:
    """A probe of the tests (tests/<name>_probe.py) under torchrun on 2 processes, from the repository root: it must
    exit 0 (its output, the end of it, is the failure's message)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", module, *args]
    result = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`hyperpod-pretrain ARGS` through the console script's entry point (pipelines.cli:main) in this process, with
    `env`, where given, as the whole environment: its exit code and what it printed. A process per call spent about a
    CPU-second on imports alone. (What a process reads at import, as the kubernetes client KUBECONFIG, needs one.)"""
    from pipelines.cli import main

    out, err = io.StringIO(), io.StringIO()
    environ = mock.patch.dict(os.environ, env, clear=True) if env is not None else contextlib.nullcontext()
    with environ, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exited:  # argparse's refusals, --help and --version
            code = exited.code if isinstance(exited.code, int) else 1
    return subprocess.CompletedProcess(["hyperpod-pretrain", *args], code, out.getvalue(), err.getvalue())

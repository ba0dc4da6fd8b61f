"""Starting from a published model under FSDP (issue 45): peak host memory per rank and load time, against
safetensors' `load_file` of the same files; and a PROJECTION (computed, not measured) for Llama 3.1 8B on p5 nodes.

The model: transformers' `LlamaForCausalLM` of tests/memory_probe.py's SHAPE with a 32,000-token vocabulary (430M
parameters, 1.72 GB), random weights saved in float32 (the trainer's dtype: the same bytes on disk and in memory) by
`save_pretrained(max_shard_size="300MB")` (the default: six files) in a temporary directory. Each round runs both
sides, their order alternating, each in processes of its own:

  fsdp      torchrun, 2 ranks, gloo, CPU, started as trainer/train_ddp.py starts from a published model:
            `trainer.parallel.parallelize(..., initial_weights=False)` (built on the meta device, sharded, given
            storage; no random weights drawn), then `trainer.published_weights.load_weights` (DCP's
            HuggingFaceStorageReader: each rank reads its own rows). The same steps run first on a tiny model, so code
            paths, caches and allocator arenas are in the baseline. Memory: peak RSS (ru_maxrss; VmHWM, reset as the
            load starts) less the peak before `parallelize`, over the model's bytes, and what the load's peak is made of
            (RssAnon and RssFile, sampled every 10 ms). The rows loaded from the last file are checked against it.
  baseline  one process: `load_file` of every file with its tensors cloned (its default mmap backend makes none of
            them resident), `load_file(backend="pread")`, and `load_file` alone (a mapping, not a load).

Each side loads cold (the page cache dropped just before: root only), then warm; where the cache cannot be dropped,
every file is read once first and all loads are warm. Medians over the rounds. Targets: peak growth <= 0.6 of the
model per rank; baseline time / fsdp time >= 0.8.

    .venv/bin/python bench/load_published.py [--rounds 3] [--shard-size 300MB] [--write-results]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script, as torchrun does

from machine import append_section, machine_lines  # noqa: E402

from tests.memory_probe import SHAPE  # noqa: E402

VOCAB = 32000  # Llama 2's: 1.72 GB in fp32
TARGET_RSS, TARGET_TIME = 0.6, 0.8
# The PROJECTION: Llama 3.1 8B as published (bf16, four files), hsdp on p5.48xlarge (8 H100 of 80 GiB a node).
P5_GPUS, NODES = 8, (2, 8)
LLAMA_8B_FILES = (4_976_698_672, 4_999_802_720, 4_915_916_176, 1_168_138_808)  # model-0000N-of-00004 (Hub)
FSX_GIB, FSX_MBPS_PER_TIB = 4800, 1000  # bench/fsdp.py's FSx for Lustre PERSISTENT_2: 4,800 MB/s in all

Record = dict[str, Any]  # one fsdp rank's figures (the child's JSON)


def kinds(cold: bool) -> tuple[str, ...]:
    return ("cold", "warm") if cold else ("warm",)


def status(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in keys}


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def drop_page_cache() -> bool:
    """Drop the page cache; False where this process may not (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        return False
    return True


class PeakSampler(threading.Thread):
    """The largest RssAnon and RssFile seen every 10 ms until stop()."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.done = {"RssAnon": 0, "RssFile": 0}, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.done.wait(0.01):
            self.peak = {k: max(v, self.peak[k]) for k, v in status(*self.peak).items()}

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.join()
        return self.peak


# -- the children --------------------------------------------------------------------------------------------------


def baseline(model_dir: Path, cold: bool) -> dict[str, float]:
    """Seconds to load every file, by way and kind ("pread cold")."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    ways = {
        "mmap+clone": lambda f: {k: v.clone() for k, v in load_file(f).items()},
        "pread": lambda f: load_file(f, backend="pread"),
        "mmap, lazy": load_file,
    }
    times = {}
    for way, load in ways.items():
        for kind in kinds(cold):
            if kind == "cold":
                drop_page_cache()
            started = time.perf_counter()
            tensors = [load(f) for f in files]
            times[f"{way} {kind}"] = time.perf_counter() - started
            del tensors
            gc.collect()
    return times


def fsdp(model_dir: Path, small_dir: Path, out: Path, cold: bool) -> None:
    """One torchrun rank: start from the published model as the trainer does, load it (cold, warm), write
    OUT/rank_<r>.json."""
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    from trainer.parallel import parallelize
    from trainer.published import PublishedModel
    from trainer.published_weights import load_weights

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def build(published: PublishedModel) -> torch.nn.Module:
        return parallelize(
            published.model_config(), "fsdp", torch.device("cpu"), seed=1, local_world=world, initial_weights=False
        ).model

    small = PublishedModel.read(small_dir)
    load_weights(build(small), small)
    gc.collect()  # FSDP's hooks hold the module in reference cycles
    published = PublishedModel.read(model_dir)
    record: Record = {"before": maxrss()}
    dist.barrier()
    started = time.perf_counter()
    model = build(published)
    record |= {"build_seconds": time.perf_counter() - started, "build_peak": maxrss()}
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.named_parameters()}
    record["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensors: whole
    record["local_bytes"] = sum(t.numel() * t.element_size() for t in local.values())
    for kind in kinds(cold):
        dist.barrier()
        if kind == "cold" and rank == 0:
            drop_page_cache()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the load's own peak from here
        start = status("RssAnon", "RssFile")
        sampler = PeakSampler()
        dist.barrier()
        started = time.perf_counter()
        load_weights(model, published)
        record[kind] = {
            "seconds": time.perf_counter() - started,
            "peak": status("VmHWM")["VmHWM"],
            "growth": {k: v - start[k] for k, v in sampler.stop().items()},
        }
    with safe_open(model_dir / published.files[-1], "pt") as f:  # the weights are the files' (this rank's rows)
        for key in f.keys():
            rows = local[key].shape[0]
            offset = rank * -(-f.get_slice(key).get_shape()[0] // world)  # FSDP2's Shard(0): ceil-sized chunks
            assert torch.equal(local[key], f.get_slice(key)[offset : offset + rows]), key
    (out / f"rank_{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------------------------------


def save_models(root: Path, shard: str) -> tuple[Path, Path]:
    """The published model (fp32, files of at most `shard`) and a tiny one of the same family for the warm-up."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = {**SHAPE, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "vocab_size": 512}
    for name, shape, size in (("model", {**SHAPE, "vocab_size": VOCAB}, shard), ("small", tiny, "100KB")):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **shape))
        model.save_pretrained(root / name, max_shard_size=size)
        del model
        gc.collect()
    return root / "model", root / "small"


def run_child(args: list[str], torchrun: bool) -> str:
    """This script as a child (one process, or 2 under torchrun, each with its share of the CPUs); its stdout."""
    script = [str(Path(__file__).resolve()), "--child", *args]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"] if torchrun else []
    threads = max(1, (os.cpu_count() or 1) // (2 if torchrun else 1))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, *launcher, *script], env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise RuntimeError(f"child {args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def measure(root: Path, rounds: int, shard: str) -> tuple[bool, list[dict[str, float]], list[list[Record]]]:
    """Whether the loads were cold; each round's baseline times and fsdp ranks' records."""
    model_dir, small_dir = save_models(root, shard)
    cold = drop_page_cache()
    if not cold:  # both sides read warm
        for path in model_dir.glob("*.safetensors"):
            path.read_bytes()
    base, runs = [], []
    for r in range(rounds):
        for side in ("baseline", "fsdp") if r % 2 == 0 else ("fsdp", "baseline"):
            if side == "baseline":
                out = run_child(["baseline", str(model_dir), str(int(cold))], torchrun=False)
                base.append(json.loads(out.strip().splitlines()[-1]))
            else:
                (out_dir := root / f"fsdp-{r}").mkdir()
                run_child(["fsdp", str(model_dir), str(small_dir), str(out_dir), str(int(cold))], torchrun=True)
                runs.append([json.loads((out_dir / f"rank_{i}.json").read_text()) for i in (0, 1)])
            print(f"round {r + 1}/{rounds}: {side} done", file=sys.stderr, flush=True)
    return cold, base, runs


def med(values: list[float]) -> float:
    return statistics.median(values)


def gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def memory_table(runs: list[list[Record]], kind: str) -> list[str]:
    """Per rank, medians over the rounds: growth over the peak RSS before `parallelize`."""
    model = runs[0][0]["model_bytes"]
    lines = [
        "| rank | shard held (GB) | after `parallelize`: peak growth (GB) | during `load_weights`: peak growth "
        "(GB) | the start's peak / model (range) | the load's make-up: largest RssAnon, RssFile growth (GB) | "
        "`parallelize`, `load_weights` (s) |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for rank in (0, 1):
        rs = [run[rank] for run in runs]
        build, load = med([r["build_peak"] - r["before"] for r in rs]), med([r[kind]["peak"] - r["before"] for r in rs])
        ratios = [(max(r["build_peak"], r[kind]["peak"]) - r["before"]) / model for r in rs]
        anon, file = (med([r[kind]["growth"][k] for r in rs]) for k in ("RssAnon", "RssFile"))
        seconds = f"{med([r['build_seconds'] for r in rs]):.2f}, {med([r[kind]['seconds'] for r in rs]):.2f}"
        lines.append(
            f"| {rank} | {gb(rs[0]['local_bytes'])} | {gb(build)} | {gb(load)} | {med(ratios):.3f} "
            f"({min(ratios):.3f}-{max(ratios):.3f}, {verdict(med(ratios) <= TARGET_RSS)}) | {gb(anon)}, "
            f"{gb(file)} | {seconds} |"
        )
    return lines


def time_table(cold: bool, base: list[dict[str, float]], runs: list[list[Record]]) -> list[str]:
    """Seconds, and baseline / fsdp (medians of the per-round ratios), cold and warm."""
    load = {k: [max(r[k]["seconds"] for r in run) for run in runs] for k in kinds(cold)}  # the slower rank
    start = {k: [max(r["build_seconds"] + r[k]["seconds"] for r in run) for run in runs] for k in kinds(cold)}

    def ratio(k: str, fsdp: list[float], *ways: str) -> float:  # several ways: the fastest of them
        return med([min(b[f"{way} {k}"] for way in ways) / t for b, t in zip(base, fsdp, strict=True)])

    lines = [
        "| side | " + " | ".join(f"{k} (s) | {k}: baseline / fsdp" for k in kinds(cold)) + " |",
        "|---|" + "---:|---:|" * len(kinds(cold)),
        "| fsdp, 2 ranks: `load_weights`, the slower rank | "
        + " | ".join(f"{med(load[k]):.3f} | (the reference)" for k in kinds(cold))
        + " |",
        "| fsdp, 2 ranks: `parallelize(initial_weights=False)` + `load_weights`: the run's start | "
        + " | ".join(
            f"{med(start[k]):.3f} | {ratio(k, start[k], 'mmap+clone', 'pread'):.2f} (faster baseline / this)"
            for k in kinds(cold)
        )
        + " |",
    ]
    for way, label in (
        ("mmap+clone", "`load_file` (mmap), its tensors cloned"),
        ("pread", '`load_file(backend="pread")`'),
        ("mmap, lazy", "`load_file` (mmap) alone: no tensor resident, not a load"),
    ):
        cells = []
        for k in kinds(cold):
            r = ratio(k, load[k], way)
            target = "" if way == "mmap, lazy" else f" ({verdict(r >= TARGET_TIME)})"
            cells.append(f"{med([b[f'{way} {k}'] for b in base]):.3f} | {r:.2f}{target}")
        lines.append(f"| baseline, 1 process: {label} | " + " | ".join(cells) + " |")
    return lines


def projection(per_rank_rate: float) -> list[str]:
    """PROJECTION, not measured: Llama 3.1 8B from FSx under hsdp on 2 and 8 p5 nodes."""
    from trainer.memory import GIB, estimate, model_shape
    from trainer.model import model_config

    config = model_config("llama-8b", 128256, 8192, eos_token_id=0)
    shape = model_shape(config)
    on_disk, largest = sum(LLAMA_8B_FILES), max(LLAMA_8B_FILES)
    slice_bf16 = config.vocab_size * config.hidden_size * 2 / P5_GPUS  # a rank's rows of the embedding, on disk
    host = 3 * slice_bf16  # its pages mapped, and its fp32 copy
    fsx = FSX_GIB / 1000 * FSX_MBPS_PER_TIB * 1e6  # FSx counts 1,000 GiB per TiB of throughput
    lines = [
        f"PROJECTION (computed, not measured): Llama 3.1 8B as published ({on_disk / 1e9:.2f} GB of bf16 in "
        f"four safetensors files, the largest {largest / 1e9:.2f} GB; {shape.parameters / 1e9:.2f}B parameters "
        f"the trainer holds in fp32), started as above (`parallelize(initial_weights=False)`, then "
        f"`load_weights`) under hsdp (fsdp on several nodes) on p5.48xlarge ({P5_GPUS} H100 of 80 GiB a node). "
        f"hsdp shards within a node: each rank reads 1/{P5_GPUS} of every tensor and every node reads the "
        f"whole model from FSx. Load time = max(a rank's bytes / the per-rank rate measured here, "
        f"{per_rank_rate / 1e9:.2f} GB/s (cold, CPU, fp32 to fp32); all nodes' bytes / FSx for Lustre "
        f"PERSISTENT_2 of {FSX_GIB:,} GiB at {FSX_MBPS_PER_TIB:,} MB/s per TiB = {fsx / 1e9:.1f} GB/s, "
        f"bench/fsdp.py's assumption). Peak host memory per rank: `parallelize` gives the weights GPU storage "
        f"(nothing on the host); during the load, the largest piece a rank reads, mapped (trainer/published_weights.py "
        f"TensorAtATimeReader opens a file per piece: {slice_bf16 / 1e9:.2f} GB, a rank's rows of the 128,256 "
        f"x 4,096 embedding in bf16), plus its fp32 copy ({2 * slice_bf16 / 1e9:.2f} GB: a blocking CPU-to-GPU "
        f"`copy_` that changes dtype converts on the CPU first, ATen/native/cuda/Copy.cu `copy_kernel_cuda`). "
        f"GPU memory per GPU: trainer/memory.py's estimate; the "
        f"load holds only the fp32 weight shard; the run's peak at 1 x 8,192 tokens with selective activation "
        f"checkpointing (as bench/memory_8b.py).",
        "",
        "| nodes x GPUs | ranks | read per rank (GB) | read from FSx in all (GB) | load time (s) | peak host "
        "memory per rank (GB) | GPU per GPU: after the load / the run's peak (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for nodes in NODES:
        per_rank, total = on_disk / P5_GPUS, on_disk * nodes
        bound = "FSx" if total / fsx > per_rank / per_rank_rate else "per-rank rate"
        gpu = estimate(shape, "hsdp", nodes * P5_GPUS, P5_GPUS, 1, 8192, "selective")
        lines.append(
            f"| {nodes} x {P5_GPUS} | {nodes * P5_GPUS} | {per_rank / 1e9:.2f} | {total / 1e9:.1f} | "
            f"{max(per_rank / per_rank_rate, total / fsx):.1f} ({bound}-bound) | {host / 1e9:.2f} | "
            f"{gpu.weights / GIB:.2f} / {gpu.total / GIB:.1f} |"
        )
    return lines


def report(cold: bool, shard: str, base: list[dict[str, float]], runs: list[list[Record]]) -> list[str]:
    model, kind = runs[0][0]["model_bytes"], "cold" if cold else "warm"
    per_rank_rate = med([run[0]["local_bytes"] / max(r[kind]["seconds"] for r in run) for run in runs])
    return [
        f"Model: llama-shaped (tests/memory_probe.py's SHAPE, vocabulary {VOCAB:,}), {model / 1e9:.2f} GB of "
        f'weights in float32, saved by transformers\' `save_pretrained(max_shard_size="{shard}")`. Medians of '
        f"{len(runs)} rounds, each one baseline process and one torchrun, their order alternating. "
        + (
            "Cold: the page cache dropped (as root) just before each timed load; warm: right after."
            if cold
            else "The page cache could not be dropped: every file was read once first, all loads warm."
        ),
        "",
        f"Peak host RSS per rank, fsdp on 2 ranks (torchrun, gloo, CPU), the {kind} load: growth over the peak "
        f"RSS before `parallelize` (target: the start's peak <= {TARGET_RSS} of the model's bytes):",
        "",
        *memory_table(runs, kind),
        "",
        f"Load time, the same {model / 1e9:.2f} GB (target: baseline / fsdp >= {TARGET_TIME}):",
        "",
        *time_table(cold, base, runs),
        "",
        f"Per-rank read rate under fsdp ({kind}): {per_rank_rate / 1e9:.2f} GB/s.",
        "",
        *projection(per_rank_rate),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-size", default="300MB", help="save_pretrained's max_shard_size (default %(default)s)")
    parser.add_argument("--write-results", action="store_true", help="append the results to bench/RESULTS.md")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        side, *paths, cold = args.child
        if side == "baseline":
            print(json.dumps(baseline(Path(paths[0]), cold == "1")))
        else:
            fsdp(*map(Path, paths), cold == "1")
        return 0
    root = Path(tempfile.mkdtemp(prefix="bench-load-published-", dir="/tmp"))
    load_start = os.getloadavg()[0]
    try:
        cold, base, runs = measure(root, args.rounds, args.shard_size)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = f"1-minute load average: {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    command = f".venv/bin/python bench/load_published.py --rounds {args.rounds} --shard-size {args.shard_size}"
    body = [f"`{command}`", "", *report(cold, args.shard_size, base, runs)]
    print("\n".join([*body, "", load]))
    if args.write_results:
        append_section(
            "starting from a published model under fsdp: host memory per rank, load time",
            body,
            [*machine_lines("torch", "safetensors", "transformers"), load],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

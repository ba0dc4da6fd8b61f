"""Peak memory of the evaluation step against its model's bf16 size, beside the loading it replaced, in one run.

For each preset (gpt2-350m and llama-1b by default): a run of it on a small staged corpus (the standard library's
email package, vocabulary 2048), whose initial weights the trainer's CheckpointManager saves as a committed DCP
checkpoint (fp32, the master weights, as training writes them). Then, each in a fresh process:

    new       the whole evaluation step, `evaluate_checkpoint(dtype="bfloat16")` on the CPU: the checkpoint read
              into a bf16 model built on the meta device, measured, sampled and exported, then the starting model
              built and measured after it (components/evaluate_checkpoint/loading.py)
    baseline  the loading before issue 58, in fp32: the checkpoint's weights read whole (read_weights), the model
              built beside them and loaded, the starting model built beside both; then the same val loss

Peak = the process's resident high-water mark (VmHWM; not getrusage's, which in a child carries the parent's peak
across exec: the parent's own make_run) less its resident memory once torch, transformers and the project are
imported (the floor), against the model's bf16 bytes. Target: new <= 1.3 x the bf16 model plus the val batches,
which a third process measures: the resident growth of the same val loss over the loaded bf16 model. It is a
measurement, not a test: it never asserts.

    PYTHONPATH=. .venv/bin/python bench/eval_memory.py [--presets gpt2-350m,llama-1b] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from machine import RESULTS, answer_child, append_section, machine_lines, memory_bytes

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

log = logging.getLogger("bench-eval-memory")
TARGET = 1.3
SEQ_LEN, BATCH, MAX_TOKENS = 256, 8, 16384


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="gpt2-350m,llama-1b")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_run(root: Path, preset: str, snapshot: Path) -> int:
    """A run of `preset` on `snapshot` with a committed checkpoint of its initial weights at step 1, as the trainer
    writes one: its config.json names the model, the snapshot and the seed. Returns the model's parameters."""
    import torch

    from components.evaluate_checkpoint.loading import empty_model
    from trainer.checkpoint import CheckpointManager
    from trainer.data import load_meta
    from trainer.layout import RunPaths
    from trainer.model import model_config

    meta = load_meta(snapshot)
    config = model_config(preset, meta["vocab_size"], SEQ_LEN, meta["eos_id"], 0.0, meta.get("bos_id"))
    run = RunPaths.of(root, preset)
    run.root.mkdir(parents=True)
    run.config.write_text(
        json.dumps(
            {
                "model": config.to_dict(),
                "trainer": {"seq_len": SEQ_LEN, "seed": 1},
                "dataset": {"dataset": snapshot.parent.parent.name, "snapshot": snapshot.name},
            }
        )
    )
    model = empty_model(config, torch.device("cpu"), torch.float32, initial_seed=1)
    manager = CheckpointManager(run.checkpoints)
    state = {"step": 1, "progress": {"tokens_seen": SEQ_LEN * BATCH}, "preset": preset}
    manager.save(1, model, torch.optim.SGD(model.parameters(), lr=0.0), state, {"torch": torch.get_rng_state()})
    manager.close()
    return sum(p.numel() for p in model.parameters())


def child_new(spec: dict[str, Any]) -> dict[str, Any]:
    from components.evaluate_checkpoint.core import evaluate_checkpoint
    from components.evaluate_checkpoint.loading import steady_host_memory

    steady_host_memory()  # as the step's process starts (component.py, the CLI's evaluate)
    floor = memory_bytes("VmRSS")
    result = evaluate_checkpoint(
        spec["root"], "email", spec["preset"], max_tokens=MAX_TOKENS, batch_size=BATCH, dtype="bfloat16"
    )
    peak = memory_bytes("VmHWM")
    return {"floor": floor, "peak": peak, "val_loss": result.val_loss, "untrained": result.untrained_val_loss}


def child_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """What the val batches themselves take: the checkpoint's bf16 model loaded as the step loads it, then the
    resident growth over the same val loss (activations, one chunk of logits, what the allocator keeps of them)."""
    import torch
    from tokenizers import Tokenizer

    from components.evaluate_checkpoint.loading import checkpoint_model, steady_host_memory
    from components.evaluate_checkpoint.measure import read_checkpoint, val_split
    from trainer.data import load_meta
    from trainer.evaluation import mean_loss, token_bytes
    from trainer.layout import TOKENIZER, RunPaths
    from trainer.model import config_from_dict

    steady_host_memory()
    run = RunPaths.of(spec["root"], spec["preset"])
    config = json.loads(run.config.read_text())
    found, state = read_checkpoint(run, "latest")
    cpu = torch.device("cpu")
    model = checkpoint_model(config_from_dict(config["model"]), found, run, state, cpu, torch.bfloat16)
    snapshot = Path(spec["snapshot"])
    lengths = token_bytes(Tokenizer.from_file(str(snapshot / TOKENIZER)), load_meta(snapshot))
    val = val_split(snapshot, "email", SEQ_LEN)
    Path("/proc/self/clear_refs").write_text("5")  # the resident high-water mark (VmHWM) from here: not the load's
    loaded = memory_bytes("VmRSS")
    mean_loss(model, val, SEQ_LEN, MAX_TOKENS, BATCH, cpu, lengths)
    return {"batch": memory_bytes("VmHWM") - loaded}


def child_baseline(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer

    from components.evaluate_checkpoint.measure import read_checkpoint, val_split
    from trainer.checkpoint import read_weights
    from trainer.data import load_meta
    from trainer.evaluation import mean_loss, token_bytes
    from trainer.layout import TOKENIZER, RunPaths
    from trainer.model import build_model, config_from_dict

    floor = memory_bytes("VmRSS")
    run = RunPaths.of(spec["root"], spec["preset"])
    config = json.loads(run.config.read_text())
    found, _ = read_checkpoint(run, "latest")
    weights = read_weights(found)
    model = build_model(config_from_dict(config["model"]))
    model.load_state_dict(weights)
    torch.manual_seed(1)
    start = build_model(config_from_dict(config["model"]))
    snapshot = Path(spec["snapshot"])
    lengths = token_bytes(Tokenizer.from_file(str(snapshot / TOKENIZER)), load_meta(snapshot))
    val = val_split(snapshot, "email", SEQ_LEN)
    cpu = torch.device("cpu")
    loss = mean_loss(model, val, SEQ_LEN, MAX_TOKENS, BATCH, cpu, lengths)[0]
    untrained = mean_loss(start, val, SEQ_LEN, MAX_TOKENS, BATCH, cpu, lengths)[0]
    return {"floor": floor, "peak": memory_bytes("VmHWM"), "val_loss": loss, "untrained": untrained}


CHILDREN = {"new": child_new, "batch": child_batch, "baseline": child_baseline}


def run_child(work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """CHILDREN[spec['kind']] in a fresh process, which imports everything it needs before its floor is read."""
    spec_path, out = work / "child.spec.json", work / "child.out.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    subprocess.run([sys.executable, __file__, "--child", str(spec_path)], env=env, check=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        # imported before the floor is read: the process's code, not the model's memory
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401

        import components.evaluate_checkpoint.core  # noqa: F401
        import trainer.checkpoint  # noqa: F401

        return answer_child(args.child, CHILDREN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from components.stage_data.core import stage_data

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = Path(sysconfig.get_paths()["stdlib"]) / "email"
        staged = stage_data(str(source), tmp, "email", vocab_size=2048, val_fraction=0.3, include=["*.py"])
        snapshot = Path(staged.tokenized_dir)
        for preset in args.presets.split(","):
            parameters = make_run(work, preset, snapshot)
            bf16 = parameters * 2
            measured = {}
            for kind in ("new", "batch", "baseline"):
                spec = {"kind": kind, "root": tmp, "preset": preset, "snapshot": str(snapshot)}
                measured[kind] = run_child(work, spec)
                log.info("%s %s: %s", preset, kind, measured[kind])
            rows.append((preset, parameters, bf16, measured))
    text = [
        "Evaluation step's peak memory (`bench/eval_memory.py`): each preset's initial weights saved by the trainer's "
        f"CheckpointManager (fp32 DCP), evaluated on the CPU over {MAX_TOKENS:,} val tokens of the stdlib email "
        f"package (vocabulary 2048, sequence {SEQ_LEN}, batch {BATCH}). new: the whole step "
        "(`evaluate_checkpoint(dtype='bfloat16')`: meta-device bf16 model filled from the checkpoint, measured, "
        "sampled, exported, then the starting model); baseline: the loading before issue 58 (weights read whole, "
        "an fp32 model beside them, the starting model beside both) and the same val loss. Held = peak resident "
        "(VmHWM) less the resident memory after imports, each in a fresh process; val batches = the same val loss's "
        f"growth over the loaded bf16 model; target = {TARGET} x bf16 model + val batches. Rerun with "
        "`PYTHONPATH=. .venv/bin/python bench/eval_memory.py --write-results`.",
        "",
        "| preset | parameters | bf16 model (GB) | val batches (GB) | new held (GB) | target (GB) | new / bf16 "
        "| baseline held (GB) | baseline / bf16 | baseline / new |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    met = True
    for preset, parameters, bf16, measured in rows:
        new, old = (measured[k]["peak"] - measured[k]["floor"] for k in ("new", "baseline"))
        target = TARGET * bf16 + measured["batch"]["batch"]
        met &= new <= target
        text.append(
            f"| {preset} | {parameters / 1e6:,.0f}M | {bf16 / 1e9:.2f} | {measured['batch']['batch'] / 1e9:.2f} | "
            f"{new / 1e9:.2f} | {target / 1e9:.2f} | {new / bf16:.2f} | {old / 1e9:.2f} | {old / bf16:.2f} | "
            f"{old / new:.2f} |"
        )
    text += ["", f"new held <= {TARGET} x bf16 model + val batches: {'met' if met else 'NOT met'} at every preset"]
    print("\n".join(text))
    if args.write_results:
        append_section("evaluation memory", text, machine_lines("torch", "transformers"))
        log.info("appended results to %s", RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

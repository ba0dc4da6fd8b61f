"""The evaluation step on a GPU: a run's checkpoint evaluated as the pipeline's step does, in bf16, with benchmarks.

Run as `python -m bench.eval_probe SNAPSHOT WORK PRESET ITEMS` (bench/gpu_check.py's `eval-gpu` case): a run of
PRESET on the staged SNAPSHOT whose initial weights the trainer's CheckpointManager saves (fp32, bench/eval_memory.py
make_run), then `evaluate_checkpoint` over 65,536 val tokens with hellaswag, piqa and lambada_openai (ITEMS each,
task data in the hub's schemas: tests/benchmark_data.py), the export on. Prints one JSON line: seconds, the GPU's
peak allocated and reserved GiB beside the model's bf16 GiB, the val loss, the benchmarks' values. On a CPU (the dry
run) the same in fp32, with no GPU counters.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/eval_memory.py imports its siblings by name

from eval_memory import make_run  # noqa: E402

from components.evaluate_checkpoint.benchmarks import BenchmarkSettings  # noqa: E402
from components.evaluate_checkpoint.core import evaluate_checkpoint  # noqa: E402
from components.evaluate_checkpoint.loading import steady_host_memory  # noqa: E402
from tests.benchmark_data import write_task_data  # noqa: E402

GIB = 2**30


def main(snapshot: Path, work: Path, preset: str, items: int) -> None:
    dataset = snapshot.parent.parent  # <root>/datasets/<name>/snapshots/<id>: the dataset, seen from WORK as a root
    (work / "datasets").mkdir(parents=True, exist_ok=True)
    (work / "datasets" / dataset.name).symlink_to(dataset, target_is_directory=True)
    parameters = make_run(work, preset, snapshot)
    tasks = write_task_data(work / "benchmark-mirror", items=items)
    benchmarks = BenchmarkSettings("hellaswag,piqa,lambada_openai", str(tasks["piqa"].parent), items)
    steady_host_memory()  # as the step's process starts
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    result = evaluate_checkpoint(str(work), dataset.name, preset, max_tokens=65536, batch_size=8, benchmarks=benchmarks)
    print(
        json.dumps(
            {
                "seconds": round(time.monotonic() - started, 1),
                "allocated_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
                "reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
                "bf16_model_gib": parameters * 2 / GIB,
                "val_loss": result.val_loss,
                "benchmarks": {f"{b['task']}:{b['metric']}": b["value"] for b in result.benchmarks},
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]))

"""Benchmark items/s of the evaluation's `run_benchmarks` (lm-eval on the in-memory model) against lm-eval run the
way its documentation runs a saved model, in one run.

Both score the same model (a preset with random weights, fixed seed, the snapshot's kind of tokenizer: BOS first), on
the same tasks (the default six), the same data (tests/benchmark_data.py's, in the hub's schemas,
`--items` per task) and the same batch size:

  ours    `run_benchmarks(model, tokenizer, ...)`: HFLM around the model in memory, `lm_eval.evaluator.evaluate`.
  direct  `lm_eval.simple_evaluate(model="hf", model_args="pretrained=<dir>,dtype=float32", ...)` on the model and
          tokenizer written with save_pretrained to a temporary directory: loads them each call, as a person's run
          does, and collects its environment report.

Each call is timed whole, task building and the data's reading included; both build the tasks with `load_tasks`
(lm-eval reads nothing from the hub here) and draw bootstrap stderrs with the same number of draws. The direct call
is given an empty TaskManager: without one, simple_evaluate indexes all of lm-eval's ~14,000 task YAMLs each call
(about 6 s here), which would measure that, not the scoring. The two
alternate, one warm-up each; medians over repeats and the median of the per-repeat ratios. Both must report the same
scores. It is a measurement, not a test: it never asserts.

    .venv/bin/python bench/benchmark_eval.py [--preset small] [--items 200] [--repeats 3] [--write-results]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import RESULTS, append_section, machine_lines

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.benchmark_data, tests.test_evaluate_benchmarks
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the saved model is read from its directory; nothing is fetched

from components.evaluate_checkpoint.benchmarks import (  # noqa: E402
    BOOTSTRAP_ITERS,
    DEFAULT_BENCHMARKS,
    load_tasks,
    parse_benchmarks,
    run_benchmarks,
)
from tests.benchmark_data import write_task_data  # noqa: E402
from tests.test_evaluate_benchmarks import small_model, snapshot_tokenizer  # noqa: E402

log = logging.getLogger("bench-benchmark-eval")
TARGET = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--items", type=int, default=200, help="documents per task")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    return p.parse_args(argv)


def scores(results: Any) -> dict[tuple[str, str], float]:
    return {
        (task, metric.partition(",")[0]): value
        for task, row in results.items()
        for metric, value in row.items()
        if metric.endswith(",none") and "_stderr" not in metric
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("lm_eval", "components"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = parse_benchmarks(DEFAULT_BENCHMARKS)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = snapshot_tokenizer(Path(tmp, "tokenizer"))
        model = small_model(tokenizer, args.preset)
        data = write_task_data(Path(tmp, "data"), items=args.items)
        export = Path(tmp, "export")
        model.save_pretrained(export)
        tokenizer.save_pretrained(export)

        def ours() -> dict[tuple[str, str], float]:
            results = run_benchmarks(model, tokenizer, tasks, data, args.batch_size, "cpu")
            return {(r.task, r.metric): r.value for r in results}

        def direct() -> dict[tuple[str, str], float]:
            out = lm_eval.simple_evaluate(
                model="hf",
                model_args=f"pretrained={export},dtype=float32",
                tasks=list(load_tasks(tasks, data)["tasks"].values()),
                task_manager=TaskManager(include_defaults=False),
                batch_size=args.batch_size,
                device="cpu",
                bootstrap_iters=BOOTSTRAP_ITERS,
                log_samples=False,
            )
            return scores(out["results"])

        measured = {"ours": ours(), "direct": direct()}  # warm-up
        items = args.items * len(tasks)
        runs: dict[str, list[float]] = {"ours": [], "direct": []}
        for n in range(args.repeats):
            for name, call in (
                (("ours", ours), ("direct", direct)) if n % 2 == 0 else (("direct", direct), ("ours", ours))
            ):
                started = time.perf_counter()
                measured[name] = call()
                runs[name].append(time.perf_counter() - started)
            log.info("repeat %d: ours %.2fs, direct %.2fs", n + 1, runs["ours"][-1], runs["direct"][-1])
    same = all(abs(v - measured["direct"][k]) <= 1e-6 * max(1.0, abs(v)) for k, v in measured["ours"].items())
    ratio = statistics.median(d / o for o, d in zip(runs["ours"], runs["direct"], strict=True))
    rate = {k: items / statistics.median(v) for k, v in runs.items()}
    text = [
        f"Benchmarks through lm-eval (`bench/benchmark_eval.py`): preset {args.preset} (random weights), the default "
        f"six tasks at {args.items} items each ({items:,} in all, 0-shot), batch {args.batch_size}, CPU; "
        f'`run_benchmarks` on the in-memory model against `lm_eval.simple_evaluate(model="hf")` on the same model '
        f"saved with save_pretrained, alternating; medians of {args.repeats} repeats, each call whole. Same scores "
        f"from both: {'yes' if same else 'NO'}. Rerun with `.venv/bin/python bench/benchmark_eval.py --write-results`.",
        "",
        "| path | median (s) | items/s |",
        "|---|---:|---:|",
        *(f"| {k} | {statistics.median(v):.2f} | {rate[k]:,.1f} |" for k, v in runs.items()),
        "",
        f"ours / direct items/s: {ratio:.3f} (target >= {TARGET}: {'met' if ratio >= TARGET else 'not met'})",
    ]
    print("\n".join(text))
    if not same:
        print("scores differ:", {k: (v, measured["direct"].get(k)) for k, v in measured["ours"].items()})
    if args.write_results:
        append_section("benchmarks through lm-eval", text, machine_lines("torch", "transformers", "lm_eval"))
        log.info("appended results to %s", RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

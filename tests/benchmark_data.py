"""Benchmark task data as the Hugging Face hub serves it (parquet, or jsonl), made with pyarrow: each default task's
published schema and file names, for the benchmark tests and the run-local test that scores them."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from components.evaluate_checkpoint.benchmarks import TASKS

ITEMS = 20
WORDS = (
    "the a man woman dog cat ball house tree water river car road book table chair runs jumps walks sits opens "
    "closes picks holds throws reads red blue green small big old new quickly slowly then and with on in under over "
    "café naïve über façade"  # acc_norm divides by characters, not bytes: these tell them apart
).split()
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# -- the six tasks' data, in the schemas the hub serves ---------------------------------------------------------------


def hellaswag_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Rowan/hellaswag: `label` is a string there (the test split's is empty); WikiHow rows carry [title] marks."""
    rows = []
    for i in range(n):
        ctx_a = f"[header] {words(rng, 4)} [title] {words(rng, 5)}." if i % 3 == 0 else f"{words(rng, 7)}."
        ctx_b = words(rng, 3)
        rows.append(
            {
                "ind": i,
                "activity_label": words(rng, 2).capitalize(),
                "ctx_a": ctx_a,
                "ctx_b": ctx_b,
                "ctx": f"{ctx_a} {ctx_b}",
                "endings": [f"{words(rng, rng.randint(2, 6))}." for _ in range(4)],
                "source_id": f"activitynet~v_{i:04d}",
                "split": "val",
                "split_type": "indomain",
                "label": str(rng.randrange(4)),
            }
        )
    return rows


HELLASWAG = pa.schema(
    [
        ("ind", pa.int32()),
        ("activity_label", pa.string()),
        ("ctx_a", pa.string()),
        ("ctx_b", pa.string()),
        ("ctx", pa.string()),
        ("endings", pa.list_(pa.string())),
        ("source_id", pa.string()),
        ("split", pa.string()),
        ("split_type", pa.string()),
        ("label", pa.string()),
    ]
)


def arc_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """allenai/ai2_arc: 3 to 5 choices, labelled A-E or 1-4 (both occur), answerKey one of the labels."""
    rows = []
    for i in range(n):
        count = rng.choice([3, 4, 4, 5])
        labels = list("ABCDE"[:count]) if i % 4 else [str(k + 1) for k in range(count)]
        texts: list[str] = []
        while len(texts) < count:  # distinct, as a question's choices are
            texts += [text] if (text := words(rng, rng.randint(1, 4))) not in texts else []
        rows.append(
            {
                "id": f"Mercury_{7000 + i}",
                "question": f"{words(rng, 8).capitalize()}?",
                "choices": {"text": texts, "label": labels},
                "answerKey": rng.choice(labels),
            }
        )
    return rows


ARC = pa.schema(
    [
        ("id", pa.string()),
        ("question", pa.string()),
        ("choices", pa.struct([("text", pa.list_(pa.string())), ("label", pa.list_(pa.string()))])),
        ("answerKey", pa.string()),
    ]
)


def piqa_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    return [
        {"goal": f"{words(rng, 6).capitalize()}.", "sol1": words(rng, 5), "sol2": words(rng, 7), "label": i % 2}
        for i in range(n)
    ]


PIQA = pa.schema([("goal", pa.string()), ("sol1", pa.string()), ("sol2", pa.string()), ("label", pa.int64())])


def winogrande_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """allenai/winogrande (winogrande_xl): a blank `_` that either option fills; `answer` is the string "1" or "2"."""
    rows = []
    for _ in range(n):
        option1, option2 = rng.sample(WORDS, 2)
        sentence = f"{words(rng, 5).capitalize()} _ {words(rng, 6)}."
        rows.append({"sentence": sentence, "option1": option1, "option2": option2, "answer": rng.choice(["1", "2"])})
    return rows


WINOGRANDE = pa.schema(
    [("sentence", pa.string()), ("option1", pa.string()), ("option2", pa.string()), ("answer", pa.string())]
)


def write_parquet(path: Path, rows: list[dict[str, Any]], schema: pa.Schema) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_task_data(root: Path, items: int = ITEMS, seed: int = 0, last_word: Any = None) -> dict[str, Path]:
    """Each default task's data under root/<task>/, named as the hub names its files (EleutherAI/lambada_openai's
    data/lambada_test.jsonl is jsonl: its copy here is test.jsonl), with a train split for hellaswag's few shots.
    `last_word(context)`, if given, picks lambada's last word for every other passage (the model's own guess)."""
    rng = random.Random(seed)
    write_parquet(root / "hellaswag/validation-00000-of-00001.parquet", hellaswag_rows(rng, items), HELLASWAG)
    write_parquet(root / "hellaswag/train-00000-of-00001.parquet", hellaswag_rows(rng, items), HELLASWAG)
    write_parquet(root / "arc_easy/test-00000-of-00001.parquet", arc_rows(rng, items), ARC)
    write_parquet(root / "arc_challenge/test.parquet", arc_rows(rng, items), ARC)
    write_parquet(root / "piqa/validation.parquet", piqa_rows(rng, items), PIQA)
    write_parquet(root / "winogrande/validation-00000-of-00001.parquet", winogrande_rows(rng, items), WINOGRANDE)
    passages = []
    for i in range(items):
        context = f"{words(rng, 12).capitalize()}. {words(rng, 10).capitalize()}"
        guess = last_word(context) if last_word is not None and i % 2 == 0 else None
        passages.append({"text": f"{context} {guess or rng.choice(WORDS)}"})
    write_jsonl(root / "lambada_openai/test.jsonl", passages)
    return {name: root / name for name in TASKS}

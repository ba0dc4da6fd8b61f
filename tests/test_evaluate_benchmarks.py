"""Benchmarks through lm-evaluation-harness (components/evaluate_checkpoint/benchmarks.py): each default task's scores
against a computation of our own (forward passes here, the prompts rebuilt from the raw rows by each task's published
rules), on data in the hub's own schemas; the one-line refusals; staging from S3 (moto's server on loopback)."""

from __future__ import annotations

import json
import math
import random
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from common.errors import InputError, StepFailed
from common.s3 import S3Settings, S3Source
from components.evaluate_checkpoint.benchmarks import (
    CURRENT,
    DEFAULT_BENCHMARKS,
    TASKS,
    BenchmarkPaths,
    BenchmarkResult,
    BenchmarkTask,
    check_benchmark_gates,
    content_sha256,
    load_tasks,
    parse_benchmark_gate,
    parse_benchmarks,
    run_benchmarks,
    stage_benchmark_data,
    staged_benchmark_data,
)
from tests.benchmark_data import (
    BOS,
    EOS,
    HELLASWAG,
    ITEMS,
    PIQA,
    hellaswag_rows,
    piqa_rows,
    words,
    write_parquet,
    write_task_data,
)

# -- a small model and the snapshot's kind of tokenizer ---------------------------------------------------------------


def snapshot_tokenizer(directory: Path) -> Any:
    """A byte-level BPE whose post-processor puts BOS first (as a snapshot's does), loaded as the export loads it."""
    from transformers import PreTrainedTokenizerFast

    from tests.tokenizer_kinds import make_tokenizer

    rng = random.Random(1)
    texts = [f"Question: {words(rng, 9)}?\nAnswer: {words(rng, 3)}. [title] {words(rng, 4)}" for _ in range(400)]
    directory.mkdir(parents=True, exist_ok=True)
    make_tokenizer("llama3", texts, vocab_size=400).save(str(directory / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), eos_token=EOS, bos_token=BOS)


def small_model(tokenizer: Any, preset: str = "tiny") -> torch.nn.Module:
    """A preset with random weights (fixed seed) and the trainer's output layer, as the evaluation holds it."""
    from components.stage_data.tokenizer import model_vocab_size
    from trainer.loss import with_output_head
    from trainer.model import build_model, model_config

    torch.manual_seed(5)
    config = model_config(
        preset, model_vocab_size(len(tokenizer)), 256, tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    return with_output_head(build_model(config)).eval()


@dataclass
class Fixture:
    model: torch.nn.Module
    tokenizer: Any
    data: dict[str, Path]
    results: list[BenchmarkResult]
    connects: list[Any]
    written: list[Path]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    """The default suite run once, with every connection refused and in an empty working directory."""
    import datasets

    tokenizer = snapshot_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    model = small_model(tokenizer)

    def greedy_word(context: str) -> str | None:
        ids = [tokenizer.bos_token_id, *tokenizer(context, add_special_tokens=False).input_ids]
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        piece = tokenizer.decode([token])
        return piece[1:] if piece.startswith(" ") and piece[1:].isalpha() else None

    data = write_task_data(tmp_path_factory.mktemp("benchmarks"), last_word=greedy_word)
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    cached = set(cache.rglob("*")) if cache.is_dir() else set()
    workdir = tmp_path_factory.mktemp("cwd")
    connects: list[Any] = []

    def refuse(self: socket.socket, address: Any) -> None:
        connects.append(address)
        raise OSError("this test allows no connection")

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        patch.setattr(socket.socket, "connect", refuse)
        results = run_benchmarks(model, tokenizer, parse_benchmarks(DEFAULT_BENCHMARKS), data, 8, "cpu")
    written = list(workdir.rglob("*")) + sorted((set(cache.rglob("*")) if cache.is_dir() else set()) - cached)
    return Fixture(model, tokenizer, data, results, connects, written)


# -- our own computation of the scores ---------------------------------------------------------------------------------


def loglikelihood(f: Fixture, context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | [BOS] context) summed over the continuation's tokens, and whether each was the argmax.
    The continuation's tokens are those of context+continuation past the context's (trailing spaces of the
    context belong to the continuation), as the harness documents its loglikelihood requests."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = f.tokenizer.backend_tokenizer.encode
    whole = [f.tokenizer.bos_token_id, *encode(context + continuation, add_special_tokens=False).ids]
    start = 1 + len(encode(context, add_special_tokens=False).ids)
    with torch.no_grad():
        logprobs = f.model(torch.tensor([whole[:-1]])).logits[0].float().log_softmax(-1)[start - 1 :]
    targets = torch.tensor(whole[start:])
    return float(logprobs.gather(1, targets[:, None]).sum()), bool((logprobs.argmax(-1) == targets).all())


def hellaswag_preprocess(text: str) -> str:
    """HellaSwag's published cleaning: WikiHow's [title] marks become sentence ends, other [marks] go."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def multiple_choice(task: str, row: dict[str, Any]) -> tuple[list[tuple[str, str]], list[str], int]:
    """The (context, continuation) of each choice, the choices' texts (acc_norm divides by their length in
    characters) and the gold index, from the raw row by the task's published prompt."""
    if task == "hellaswag":
        query = hellaswag_preprocess(f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}")
        choices = [hellaswag_preprocess(e) for e in row["endings"]]
        return [(query, f" {c}") for c in choices], choices, int(row["label"])
    if task in ("arc_easy", "arc_challenge"):
        choices = row["choices"]["text"]
        prompt = f"Question: {row['question']}\nAnswer:"
        return [(prompt, f" {c}") for c in choices], choices, row["choices"]["label"].index(row["answerKey"])
    if task == "piqa":
        choices = [row["sol1"], row["sol2"]]
        return [(f"Question: {row['goal']}\nAnswer:", f" {c}") for c in choices], choices, row["label"]
    assert task == "winogrande"  # partial scoring: each option fills the blank; the rest of the sentence is scored
    blank = row["sentence"].index("_")
    contexts = [row["sentence"][:blank] + row["option1"], row["sentence"][:blank] + row["option2"]]
    rest = " " + row["sentence"][blank + 1 :].strip()
    return [(c, rest) for c in contexts], contexts, {"1": 0, "2": 1}[row["answer"]]


def rows_of(directory: Path, split: str) -> list[dict[str, Any]]:
    (path,) = [p for p in directory.iterdir() if p.name.startswith(split)]
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    return pq.read_table(path).to_pylist()


def scored(f: Fixture, task: str) -> dict[str, float]:
    return {r.metric: r.value for r in f.results if r.task == task}


@pytest.mark.parametrize("task", ["hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande"])
def test_a_multiple_choice_task_scores_as_our_own_computation(bench: Fixture, task: str) -> None:
    correct, correct_norm, margins = [], [], []
    for row in rows_of(bench.data[task], TASKS[task].eval_split):
        requests, choices, gold = multiple_choice(task, row)
        lls = [loglikelihood(bench, context, continuation)[0] for context, continuation in requests]
        normed = [ll / len(choice) for ll, choice in zip(lls, choices, strict=True)]
        correct.append(float(max(range(len(lls)), key=lls.__getitem__) == gold))
        correct_norm.append(float(max(range(len(normed)), key=normed.__getitem__) == gold))
        margins += [abs(a - b) for i, a in enumerate(lls) for b in lls[i + 1 :]]
    assert min(margins) > 1e-4, "two choices score alike: the batched and unbatched forward passes could disagree"
    expected = {"acc": sum(correct) / ITEMS} | ({"acc_norm": sum(correct_norm) / ITEMS} if task != "winogrande" else {})
    assert scored(bench, task) == expected


def test_lambada_scores_the_last_word_as_our_own_computation(bench: Fixture) -> None:
    lls, greedy = [], []
    for row in rows_of(bench.data["lambada_openai"], "test"):
        *context, last = row["text"].split(" ")
        ll, is_greedy = loglikelihood(bench, " ".join(context), f" {last}")
        lls.append(ll)
        greedy.append(float(is_greedy))
    acc = sum(greedy) / ITEMS
    assert 0 < acc < 1, "some passages end in the model's own guess, others not: acc tells them apart"
    measured = scored(bench, "lambada_openai")
    assert measured["acc"] == acc
    assert measured["perplexity"] == pytest.approx(math.exp(-sum(lls) / ITEMS), rel=1e-5)


def test_one_row_per_task_and_metric_with_the_data_identity_and_nothing_fetched_or_written(bench: Fixture) -> None:
    assert [(r.task, r.metric) for r in bench.results] == [
        ("hellaswag", "acc"),
        ("hellaswag", "acc_norm"),
        ("arc_easy", "acc"),
        ("arc_easy", "acc_norm"),
        ("arc_challenge", "acc"),
        ("arc_challenge", "acc_norm"),
        ("piqa", "acc"),
        ("piqa", "acc_norm"),
        ("winogrande", "acc"),
        ("lambada_openai", "perplexity"),
        ("lambada_openai", "acc"),
    ]
    for result in bench.results:
        assert (result.items, result.shots) == (ITEMS, 0)
        assert result.data_sha256 == content_sha256(bench.data[result.task])
        assert result.stderr is not None and result.stderr > 0
    assert bench.connects == []
    assert bench.written == []


def test_shots_read_the_train_split_and_limit_caps_the_items(bench: Fixture, tmp_path: Path) -> None:
    task = BenchmarkTask("hellaswag", 2)
    built = load_tasks([task], bench.data)["tasks"]["hellaswag"]
    train = rows_of(bench.data["hellaswag"], "train")
    assert [doc["ctx_a"] for doc in built.fewshot_docs()] == [row["ctx_a"] for row in train]
    (result, _) = run_benchmarks(bench.model, bench.tokenizer, [task], bench.data, 4, "cpu", limit=5)
    assert (result.metric, result.items, result.shots) == ("acc", 5, 2)
    write_parquet(tmp_path / "validation.parquet", train, HELLASWAG)  # no train split beside it
    with pytest.raises(InputError, match="holds no train split") as error:
        run_benchmarks(bench.model, bench.tokenizer, [task], {"hellaswag": tmp_path}, 4, "cpu")
    one_line(error)


def one_line(error: pytest.ExceptionInfo[InputError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_the_benchmark_list() -> None:
    assert parse_benchmarks("") == []
    assert [str(t) for t in parse_benchmarks(DEFAULT_BENCHMARKS)] == DEFAULT_BENCHMARKS.split(",")
    assert parse_benchmarks(" hellaswag:10 , piqa:0,") == [BenchmarkTask("hellaswag", 10), BenchmarkTask("piqa")]
    with pytest.raises(InputError) as error:
        parse_benchmarks("hellaswag,mmlu:5")
    assert "'mmlu'" in one_line(error) and "lambada_openai" in one_line(error)
    for bad, says in (
        ("piqa:-1", "whole number"),
        ("piqa:two", "whole number"),
        ("piqa:²", "whole number"),
        ("piqa:", "whole number"),
        ("lambada_openai:3", "0-shot"),
        ("piqa,piqa:5", "twice"),
    ):
        with pytest.raises(InputError, match=says) as error:
            parse_benchmarks(bad)
        one_line(error)


def result(task: str, metric: str, value: float) -> BenchmarkResult:
    return BenchmarkResult(task, metric, value, 0.01, 0, 100, "0" * 64)


def test_gates() -> None:
    gates = parse_benchmark_gate("hellaswag:acc_norm>=0.30, lambada_openai:perplexity<40,piqa:acc>0.5,piqa:acc<=0.9")
    assert [str(g) for g in gates] == [
        "hellaswag:acc_norm>=0.3",
        "lambada_openai:perplexity<40",
        "piqa:acc>0.5",
        "piqa:acc<=0.9",
    ]
    measured = [
        result("hellaswag", "acc_norm", 0.25),
        result("lambada_openai", "perplexity", 39.0),
        result("piqa", "acc", 0.5),
    ]
    failed = [words for ok, words in check_benchmark_gates(gates, measured) if not ok]
    assert failed == ["benchmark hellaswag acc_norm 0.2500, needed >= 0.3", "benchmark piqa acc 0.5000, needed > 0.5"]
    assert check_benchmark_gates(gates[:1], [result("hellaswag", "acc_norm", 0.3)]) == [
        (True, "benchmark hellaswag acc_norm 0.3000, >= 0.3")
    ]
    assert not check_benchmark_gates(gates[:1], [result("hellaswag", "acc_norm", math.nan)])[0][0]
    assert parse_benchmark_gate("") == []
    for bad, says in (
        ("hellaswag:acc=0.3", "task:metric>=value"),
        ("mmlu:acc>=0.3", "not supported"),
        ("winogrande:acc_norm>=0.5", "winogrande measures acc"),
        ("piqa:acc>=high", "not a number"),
        ("piqa:acc>=nan", "not a number"),
    ):
        with pytest.raises(InputError, match=says) as error:
            parse_benchmark_gate(bad)
        one_line(error)
    with pytest.raises(InputError, match="not among the benchmarks run") as error:
        parse_benchmark_gate("piqa:acc>=0.5", parse_benchmarks("hellaswag"))
    one_line(error)
    with pytest.raises(InputError, match="piqa acc was not measured") as error:
        check_benchmark_gates(parse_benchmark_gate("piqa:acc>=0.5"), measured[:2])
    one_line(error)


@pytest.mark.parametrize(
    "change, column, says",
    [
        (lambda row: {"question" if k == "goal" else k: v for k, v in row.items()}, "question", "question (string)"),
        (lambda row: row | {"label": str(row["label"])}, "label", "label (string)"),  # "0" is no choice's index
    ],
)
def test_a_data_set_with_the_wrong_columns_is_refused_in_one_line(
    bench: Fixture, tmp_path: Path, change: Any, column: str, says: str
) -> None:
    rows = [change(row) for row in piqa_rows(random.Random(0), 3)]
    write_parquet(tmp_path / "piqa/validation.parquet", rows, pa.Table.from_pylist(rows).schema)
    with pytest.raises(InputError) as error:
        run_benchmarks(bench.model, bench.tokenizer, parse_benchmarks("piqa"), {"piqa": tmp_path / "piqa"}, 4, "cpu")
    message = one_line(error)
    assert message.startswith(f"benchmark piqa: {tmp_path / 'piqa/validation.parquet'} has the columns ")
    assert says in message and "expected goal (string), sol1 (string), sol2 (string), label (integer)" in message


def test_missing_data_is_refused_in_one_line_saying_what_and_where(tmp_path: Path) -> None:
    with pytest.raises(InputError) as error:
        staged_benchmark_data(parse_benchmarks("piqa,winogrande"), str(tmp_path))
    message = one_line(error)
    assert message.startswith(f"benchmark piqa: no staged data in {tmp_path / 'benchmarks/piqa'}")
    assert "validation.parquet or validation.jsonl" in message and "baber/piqa" in message and "/piqa/" in message
    copy = BenchmarkPaths.of(tmp_path, "hellaswag").copy("ab" * 32)
    write_parquet(copy / "validation.parquet", hellaswag_rows(random.Random(0), 2), HELLASWAG)
    (copy.parent / CURRENT).write_text(json.dumps({"sha256": "ab" * 32, "directory": copy.name}))
    assert staged_benchmark_data(parse_benchmarks("hellaswag"), str(tmp_path)) == {"hellaswag": copy}
    with pytest.raises(InputError, match=r"holds no train split: expected train\.parquet or train\.jsonl") as error:
        staged_benchmark_data(parse_benchmarks("hellaswag:5"), str(tmp_path))
    one_line(error)


# -- staging from S3 ---------------------------------------------------------------------------------------------------


@pytest.fixture
def s3_bucket(s3_endpoint: str, aws_env: None, request: pytest.FixtureRequest) -> tuple[Any, str]:
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    name = f"bench-{re.sub(r'[^a-z0-9]+', '-', request.node.name.lower())[:40].strip('-')}"
    client.create_bucket(Bucket=name)
    return client, name


def upload(client: Any, bucket: str, source: Path, prefix: str) -> None:
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.relative_to(source).as_posix()}", Body=path.read_bytes())


def test_staging_copies_once_content_addressed_and_again_when_the_data_changes(
    s3_bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, bucket = s3_bucket
    source = tmp_path / "source"
    write_task_data(source)
    upload(client, bucket, source, "mirror")
    client.put_object(Bucket=bucket, Key="mirror/piqa/README.md", Body=b"not a split")
    tasks, settings, root = (
        parse_benchmarks("piqa,lambada_openai"),
        S3Settings(endpoint_url=s3_endpoint),
        tmp_path / "fsx",
    )
    first = stage_benchmark_data(tasks, f"s3://{bucket}/mirror", str(root), settings)
    data = staged_benchmark_data(tasks, str(root))
    for task in tasks:
        copy = data[task.name]
        assert copy == BenchmarkPaths.of(root, task.name).copy(first[task.name])
        assert first[task.name] == content_sha256(copy) == content_sha256(source / task.name)
        assert json.loads((copy.parent / CURRENT).read_text())["sha256"] == first[task.name]
    assert sorted(p.name for p in data["piqa"].iterdir()) == ["validation.parquet"]  # the README is no split

    fetched: list[str] = []
    fetch = S3Source.fetch
    monkeypatch.setattr(S3Source, "fetch", lambda self, obj, *a: fetched.append(obj.key) or fetch(self, obj, *a))
    assert stage_benchmark_data(tasks, f"s3://{bucket}/mirror", str(root), settings) == first
    assert fetched == []

    write_parquet(source / "piqa/validation.parquet", piqa_rows(random.Random(9), ITEMS), PIQA)
    upload(client, bucket, source / "piqa", "mirror/piqa")
    second = stage_benchmark_data(tasks, f"s3://{bucket}/mirror", str(root), settings)
    assert fetched == ["validation.parquet"]
    assert second["piqa"] != first["piqa"] and second["lambada_openai"] == first["lambada_openai"]
    assert staged_benchmark_data(tasks, str(root))["piqa"].name == second["piqa"][:12]
    assert sorted(p.name for p in (root / "benchmarks/piqa").iterdir()) == sorted(
        [CURRENT, first["piqa"][:12], second["piqa"][:12]]
    )


def test_a_staging_cut_off_midway_leaves_nothing_the_evaluation_reads(
    s3_bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, bucket = s3_bucket
    source = tmp_path / "source"
    write_task_data(source)
    upload(client, bucket, source / "hellaswag", "mirror/hellaswag")
    tasks, settings, root = parse_benchmarks("hellaswag"), S3Settings(endpoint_url=s3_endpoint), tmp_path / "fsx"
    fetch = S3Source.fetch

    def cut_off(self: S3Source, obj: Any, out: Any, on_bytes: Any) -> str:
        if obj.key.startswith("validation"):  # the second object: train is copied whole by then
            out.write(b"PAR1 half a file")
            raise StepFailed("the connection broke off")
        return fetch(self, obj, out, on_bytes)

    monkeypatch.setattr(S3Source, "fetch", cut_off)
    with pytest.raises(StepFailed):
        stage_benchmark_data(tasks, f"s3://{bucket}/mirror", str(root), settings)
    assert list((root / "benchmarks/hellaswag").iterdir()) == []
    with pytest.raises(InputError, match="no staged data"):
        staged_benchmark_data(tasks, str(root))

    monkeypatch.setattr(S3Source, "fetch", fetch)
    good = stage_benchmark_data(tasks, f"s3://{bucket}/mirror", str(root), settings)["hellaswag"]
    write_parquet(
        source / "hellaswag/validation-00000-of-00001.parquet", hellaswag_rows(random.Random(7), 5), HELLASWAG
    )
    upload(client, bucket, source / "hellaswag", "mirror/hellaswag")
    monkeypatch.setattr(S3Source, "fetch", cut_off)
    with pytest.raises(StepFailed):
        stage_benchmark_data(tasks, f"s3://{bucket}/mirror", str(root), settings)
    assert sorted(p.name for p in (root / "benchmarks/hellaswag").iterdir()) == sorted([CURRENT, good[:12]])
    assert content_sha256(staged_benchmark_data(tasks, str(root))["hellaswag"]) == good


def test_staging_refuses_a_prefix_without_the_scored_split(
    s3_bucket: tuple[Any, str], s3_endpoint: str, tmp_path: Path
) -> None:
    client, bucket = s3_bucket
    client.put_object(Bucket=bucket, Key="mirror/lambada_openai/data/lambada_test.jsonl", Body=b'{"text": "a b"}\n')
    with pytest.raises(InputError) as error:
        stage_benchmark_data(
            parse_benchmarks("lambada_openai"),
            f"s3://{bucket}/mirror",
            str(tmp_path),
            S3Settings(endpoint_url=s3_endpoint),
        )
    message = one_line(error)
    assert message.startswith(f"benchmark lambada_openai: s3://{bucket}/mirror/lambada_openai/ holds no test split")
    assert "test.parquet or test.jsonl" in message and "data/lambada_test.jsonl copied as test.jsonl" in message
    with pytest.raises(InputError) as error:
        stage_benchmark_data(
            parse_benchmarks("piqa"), f"s3://{bucket}/mirror", str(tmp_path), S3Settings(endpoint_url=s3_endpoint)
        )
    message = one_line(error)
    assert "no objects under prefix" in message and "expected validation.parquet or validation.jsonl" in message

"""Benchmarks: lm-evaluation-harness's own tasks (hellaswag, arc, piqa, winogrande, lambada_openai) run through its
Python API on the in-memory model, each task's data read from the volume, never from the Hugging Face hub.

The data sets are the hub's split files (parquet or jsonl, as the hub serves them), mirrored once into S3 under
`<uri>/<task>/` and staged from there onto the volume, content-addressed:

    <root>/benchmarks/<task>/<sha12>/...     the split files, as named under the prefix; never changed once there
    <root>/benchmarks/<task>/current.json    which copy the newest staging made, and the listing it was made from

The evaluation reads the copy current.json names. lm-eval builds each task from its own YAML (prompts, choices,
metrics: nothing is copied here), with one override: `custom_dataset`, which hands it our tables, so its
`datasets.load_dataset` (the hub, the datasets cache) never runs. The columns are checked first: a file with other
columns fails in one line, not as an lm-eval traceback or a silently wrong score (piqa's label as a string never
equals the index of a choice).

This module imports neither torch nor lm-eval at the top: the CLI checks the benchmark and gate settings with it
before anything is submitted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import operator
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import InputError
from common.objects import safe_key, sha256_of
from trainer.atomic import current_umask, fsync_dir, write_json

if TYPE_CHECKING:
    import pyarrow as pa
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from common.s3 import S3Settings, S3Source
    from components.stage_data.sources import LocalSource

log = logging.getLogger(__name__)

DEFAULT_BENCHMARKS = "hellaswag,arc_easy,arc_challenge,piqa,winogrande,lambada_openai"
FEWSHOT_SEED = 1234  # lm-eval's own default (simple_evaluate's fewshot_random_seed): the same examples every run
BOOTSTRAP_ITERS = 1000  # draws for a bootstrapped stderr (perplexity's); lm-eval's default 100000 takes minutes
CURRENT = "current.json"
_GROUP = "hyperpod_benchmarks"  # the group the tasks are loaded in: its members take our overrides
_FORMATS = (".parquet", ".jsonl")

# Column kinds, as the hub's files type them and lm-eval's task code reads them.
STRING, INTEGER, LABEL, STRINGS, CHOICES = (
    "string",
    "integer",
    "string or integer",
    "list of strings",
    "struct of text and label, lists of strings",
)


@dataclass(frozen=True)
class TaskData:
    """What a supported task reads: lm-eval's task directory, the hub data set its YAML names, the split it scores,
    the split its few-shot examples come from (None: 0-shot only), the columns its prompts read, its metrics, and
    where the hub's files are not named after their split, which to copy under which name."""

    lm_eval_dir: str
    hub: str
    eval_split: str
    fewshot_split: str | None
    columns: dict[str, str]
    metrics: tuple[str, ...]
    hint: str = ""


_ARC = {"id": STRING, "question": STRING, "choices": CHOICES, "answerKey": STRING}
TASKS: dict[str, TaskData] = {
    "hellaswag": TaskData(
        "hellaswag",
        "Rowan/hellaswag",
        "validation",
        "train",
        {"activity_label": STRING, "ctx_a": STRING, "ctx_b": STRING, "endings": STRINGS, "label": LABEL},
        ("acc", "acc_norm"),
    ),
    "arc_easy": TaskData("arc", "allenai/ai2_arc (ARC-Easy)", "test", "train", _ARC, ("acc", "acc_norm")),
    "arc_challenge": TaskData("arc", "allenai/ai2_arc (ARC-Challenge)", "test", "train", _ARC, ("acc", "acc_norm")),
    "piqa": TaskData(
        "piqa",
        "baber/piqa",
        "validation",
        "train",
        {"goal": STRING, "sol1": STRING, "sol2": STRING, "label": INTEGER},
        ("acc", "acc_norm"),
    ),
    "winogrande": TaskData(
        "winogrande",
        "allenai/winogrande (winogrande_xl)",
        "validation",
        "train",
        {"sentence": STRING, "option1": STRING, "option2": STRING, "answer": STRING},
        ("acc",),  # lm-eval's winogrande scores the partial sentence after each option: acc only
    ),
    "lambada_openai": TaskData(
        "lambada",
        "EleutherAI/lambada_openai (default)",
        "test",
        None,
        {"text": STRING},
        ("perplexity", "acc"),
        hint="its data/lambada_test.jsonl copied as test.jsonl",
    ),
}


@dataclass(frozen=True)
class BenchmarkTask:
    name: str
    shots: int = 0

    def __str__(self) -> str:
        return f"{self.name}:{self.shots}" if self.shots else self.name

    @property
    def data(self) -> TaskData:
        return TASKS[self.name]

    def splits(self) -> list[str]:
        """The splits this run of the task reads: the scored one, and the few-shot examples' with shots."""
        return [self.data.eval_split] + ([self.data.fewshot_split] if self.shots and self.data.fewshot_split else [])


@dataclass(frozen=True)
class BenchmarkResult:
    """One metric of one task, as lm-eval computed it over `items` documents of the data whose content hash is
    `data_sha256` (the staged copy's, so results compare only on the same data)."""

    task: str
    metric: str
    value: float
    stderr: float | None
    shots: int
    items: int
    data_sha256: str


@dataclass(frozen=True)
class BenchmarkSettings:
    """What a run asks of the benchmarks: the tasks ("hellaswag,arc_easy:5"; "" for none), where their data is
    mirrored (s3://bucket/prefix, or a local directory for a laptop's run; staged from there first; "": what the
    volume holds), and at most how many items of each."""

    tasks: str = ""
    data_uri: str = ""
    limit: int = 0  # 0: every item of the scored split

    def checked(self, gate: str) -> tuple[list[BenchmarkTask], list[BenchmarkGate]]:
        """The tasks and the gates on them, refused in one line when malformed (what a submission checks)."""
        tasks = parse_benchmarks(self.tasks)
        gates = parse_benchmark_gate(gate, tasks)
        if self.limit < 0:
            raise InputError(f"benchmark limit {self.limit}: give a count of items per task, or 0 for all")
        return tasks, gates

    def ready(
        self, storage_root: str, gate: str, s3_settings: S3Settings
    ) -> tuple[list[BenchmarkTask], list[BenchmarkGate], dict[str, Path]]:
        """The tasks, the gates on them and each task's staged data, every one checked (the columns read) before a
        model is loaded: a bad name, gate, limit or data set is one line, and nothing is written but the staging."""
        tasks, gates = self.checked(gate)
        if tasks and self.data_uri:
            stage_benchmark_data(tasks, self.data_uri, storage_root, s3_settings)
        data = staged_benchmark_data(tasks, storage_root)
        for task in tasks:
            for split in task.splits():
                read_split(task, data[task.name], split)
        return tasks, gates, data


def benchmark_rows(
    trained: list[BenchmarkResult], start: list[BenchmarkResult], baseline: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """EvalResult.benchmarks: each task's metric for the trained model beside the starting model's and, when the
    baseline's evaluation measured the same task, shots and data, the baseline's."""
    started = {(r.task, r.metric): r.value for r in start}
    theirs = {
        (row["task"], row["metric"], row["shots"], row["data_sha256"]): row["value"]
        for row in (baseline or {}).get("benchmarks") or []
    }
    return [
        {
            **asdict(r),
            "start_value": started.get((r.task, r.metric)),
            "baseline_value": theirs.get((r.task, r.metric, r.shots, r.data_sha256)),
        }
        for r in trained
    ]


@dataclass(frozen=True)
class BenchmarkGate:
    task: str
    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.task}:{self.metric}{self.op}{self.threshold:g}"


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_GATE = re.compile(r"^([A-Za-z0-9_]+):([A-Za-z_]+)\s*(>=|<=|>|<)\s*(\S+)$")


def _unknown(name: str) -> InputError:
    return InputError(f"benchmark {name!r} is not supported: choose among {', '.join(TASKS)}")


def parse_benchmarks(text: str) -> list[BenchmarkTask]:
    """`task` or `task:shots`, comma-separated (DEFAULT_BENCHMARKS: all 0-shot); "" for none."""
    tasks: list[BenchmarkTask] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, shots_text = item.partition(":")
        name = name.strip()
        if name not in TASKS:
            raise _unknown(name)
        shots = 0
        if sep:
            if not re.fullmatch(r"[0-9]+", shots_text.strip()):
                raise InputError(f"benchmark {item!r}: the shots after ':' must be a whole number >= 0")
            shots = int(shots_text)
        if shots and TASKS[name].fewshot_split is None:
            raise InputError(f"benchmark {item!r}: {name} has no split to draw few-shot examples from; run it 0-shot")
        if any(task.name == name for task in tasks):
            raise InputError(f"benchmark {name} is named twice in {text!r}")
        tasks.append(BenchmarkTask(name, shots))
    return tasks


def parse_benchmark_gate(text: str, tasks: list[BenchmarkTask] | None = None) -> list[BenchmarkGate]:
    """`task:metric>=value`, comma-separated (>=, <=, >, <); "" for none. With `tasks` (the benchmarks run), a gate
    on a task not among them is refused here, before anything runs."""
    gates = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        match = _GATE.match(item)
        if not match:
            raise InputError(
                f"benchmark gate {item!r}: write task:metric>=value (or <=, >, <), e.g. hellaswag:acc>=0.3"
            )
        name, metric, op, value = match.groups()
        if name not in TASKS:
            raise _unknown(name)
        if metric not in TASKS[name].metrics:
            raise InputError(f"benchmark gate {item!r}: {name} measures {', '.join(TASKS[name].metrics)}")
        try:
            threshold = float(value)
        except ValueError:
            threshold = math.nan
        if not math.isfinite(threshold):
            raise InputError(f"benchmark gate {item!r}: the threshold {value!r} is not a number")
        if tasks is not None and name not in {task.name for task in tasks}:
            raise InputError(
                f"benchmark gate {item!r}: {name} is not among the benchmarks run "
                f"({', '.join(str(task) for task in tasks) or 'none'})"
            )
        gates.append(BenchmarkGate(name, metric, op, threshold))
    return gates


def check_benchmark_gates(gates: list[BenchmarkGate], results: list[BenchmarkResult]) -> list[tuple[bool, str]]:
    """Each gate's verdict and its words (the task, metric, measured value and threshold), in the gates' order."""
    measured = {(r.task, r.metric): r.value for r in results}
    verdicts = []
    for gate in gates:
        if (gate.task, gate.metric) not in measured:
            raise InputError(
                f"benchmark gate {gate}: {gate.task} {gate.metric} was not measured "
                f"(measured: {', '.join(f'{t} {m}' for t, m in measured) or 'nothing'})"
            )
        value = measured[gate.task, gate.metric]
        ok = _OPS[gate.op](value, gate.threshold)  # NaN fails every comparison
        words = f"{gate.op} {gate.threshold:g}" if ok else f"needed {gate.op} {gate.threshold:g}"
        verdicts.append((ok, f"benchmark {gate.task} {gate.metric} {value:.4f}, {words}"))
    return verdicts


# -- the data on the volume ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchmarkPaths:
    """Where a task's data lives on the volume (see the module docstring)."""

    root: Path

    @classmethod
    def of(cls, storage_root: str | Path, task: str) -> BenchmarkPaths:
        return cls(Path(storage_root) / "benchmarks" / task)

    @property
    def current(self) -> Path:
        return self.root / CURRENT

    def copy(self, sha256: str) -> Path:
        return self.root / sha256[:12]


def split_of(relative: str, splits: list[str]) -> str | None:
    """The split a file under a task's prefix holds: `<split>.parquet|jsonl`, the hub's shards
    (`<split>-00000-of-00001.parquet`), or any such file in a directory named after the split (the hub's parquet
    conversion: `<config>/<split>/0000.parquet`); None for any other file (README.md, other splits)."""
    path = Path(relative)
    if path.suffix not in _FORMATS:
        return None
    for split in splits:
        if path.stem == split or path.stem.startswith(f"{split}-") or path.parent.name == split:
            return split
    return None


def split_files(directory: Path, split: str) -> list[Path]:
    return sorted(
        p for p in directory.rglob("*") if p.is_file() and split_of(p.relative_to(directory).as_posix(), [split])
    )


def content_sha256(directory: Path) -> str:
    """The identity of a task's data: its files' relative names and sha256s, in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(directory).as_posix()}\0{sha256_of(path)}\n".encode())
    return digest.hexdigest()


def _expected(task: BenchmarkTask, split: str) -> str:
    """What a missing split should have been, and how to get it there, for the one-line refusals."""
    hint = f": {task.data.hint}" if task.data.hint else ""
    return (
        f"{split}.parquet or {split}.jsonl (the {split} split of the hub's {task.data.hub}{hint}; the hub's shard "
        f"names {split}-00000-of-00001.parquet do too), mirrored into S3 under <benchmark data URI>/{task.name}/ and "
        "staged from there"
    )


def stage_benchmark_data(
    tasks: list[BenchmarkTask], source_uri: str, storage_root: str, s3_settings: S3Settings
) -> dict[str, str]:
    """Copy each task's split files from `<source_uri>/<task>/` (S3, or a local directory for a laptop's run) onto
    the volume, once; task -> the copy's sha256.

    A task whose listing (keys, sizes, ETags) is the one its current copy was made from is not copied again. Else
    its files are downloaded (verified against the listing) into a temporary directory beside the copies, hashed,
    and renamed into `<sha12>/` whole (or dropped, when that content is there already), and only then does
    current.json name it: a staging cut off midway leaves the previous copy current and nothing the evaluation
    reads half-written."""
    from common.s3 import S3Source
    from components.stage_data.sources import LocalSource

    staged = {}
    for task in tasks:
        uri = f"{source_uri.rstrip('/')}/{task.name}/"
        try:
            source = (
                S3Source(uri, s3_settings, what=f"benchmark {task.name} data")
                if uri.startswith("s3://")
                else LocalSource(uri)
            )
        except InputError as exc:
            raise InputError(
                f"benchmark {task.name}: {exc}; expected {_expected(task, task.data.eval_split)}"
            ) from None
        try:
            staged[task.name] = _stage_task(task, source, BenchmarkPaths.of(storage_root, task.name))
        finally:
            source.close()
    return staged


def _stage_task(task: BenchmarkTask, source: S3Source | LocalSource, paths: BenchmarkPaths) -> str:
    every_split = [task.data.eval_split] + ([task.data.fewshot_split] if task.data.fewshot_split else [])
    try:
        listed = source.list()
    except InputError as exc:  # no objects there, or no access: say what belongs there too
        raise InputError(f"{exc}; expected {_expected(task, task.data.eval_split)}") from None
    objects = sorted((o for o in listed if split_of(o.key, every_split)), key=lambda o: o.key)
    found = {split_of(o.key, every_split) for o in objects}
    for split in task.splits():
        if split not in found:
            raise InputError(
                f"benchmark {task.name}: {source.uri} holds no {split} split: expected {_expected(task, split)}"
            )
    listing = [[o.key, o.size, o.etag or str(o.mtime_ns)] for o in objects]  # a local file: its modification time
    current = _read_current(paths)
    if current and current.get("source") == source.uri and current.get("objects") == listing:
        copy = paths.root / current["directory"]
        if all((copy / key).is_file() for key, _, _ in listing):
            log.info("benchmark %s: the copy in %s is up to date with %s: nothing copied", task.name, copy, source.uri)
            return current["sha256"]
    paths.root.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=".staging-", dir=paths.root))
    try:
        os.chmod(temporary, 0o777 & ~current_umask())  # mkdtemp makes it 0700: teammates read the copy too
        for obj in objects:
            target = temporary / safe_key(obj.key, source.uri)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "w+b") as out:
                source.fetch(obj, out, lambda _: None)
                out.flush()
                os.fsync(out.fileno())
        sha256 = content_sha256(temporary)
        copy = paths.copy(sha256)
        if not copy.is_dir():
            try:
                os.rename(temporary, copy)
            except OSError:
                if not copy.is_dir():  # else another staging put the same content there first
                    raise
            fsync_dir(paths.root)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    write_json(paths.current, {"sha256": sha256, "directory": copy.name, "source": source.uri, "objects": listing})
    log.info(
        "benchmark %s: staged %d files (%.1f MB) from %s into %s",
        task.name,
        len(objects),
        sum(o.size for o in objects) / 1e6,
        source.uri,
        copy,
    )
    return sha256


def _read_current(paths: BenchmarkPaths) -> dict[str, Any] | None:
    try:
        current = json.loads(paths.current.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(current, dict) or not re.fullmatch(r"[0-9a-f]{12}", str(current.get("directory"))):
        return None  # not ours: the directory it names must be one of the copies beside it
    return current if isinstance(current.get("sha256"), str) else None


def staged_benchmark_data(tasks: list[BenchmarkTask], storage_root: str) -> dict[str, Path]:
    """Each task's current copy on the volume, holding the splits this run reads; a task without one is refused in
    one line saying which file was expected, where, and how to put it there."""
    data = {}
    for task in tasks:
        paths = BenchmarkPaths.of(storage_root, task.name)
        current = _read_current(paths)
        if current is None:
            raise InputError(
                f"benchmark {task.name}: no staged data in {paths.root} (no {CURRENT}): expected "
                f"{_expected(task, task.data.eval_split)}"
            )
        copy = paths.root / current["directory"]
        for split in task.splits():
            if not copy.is_dir() or not split_files(copy, split):
                raise InputError(
                    f"benchmark {task.name}: {copy} holds no {split} split: expected {_expected(task, split)}"
                )
        data[task.name] = copy
    return data


# -- reading and running --------------------------------------------------------------------------------------------


def _is_kind(kind: str, value: pa.DataType) -> bool:
    import pyarrow as pa

    def strings(t: pa.DataType) -> bool:
        return (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_kind(STRING, t.value_type)

    if kind == STRING:
        return pa.types.is_string(value) or pa.types.is_large_string(value)
    if kind == INTEGER:
        return pa.types.is_integer(value)
    if kind == LABEL:
        return _is_kind(STRING, value) or _is_kind(INTEGER, value)
    if kind == STRINGS:
        return strings(value)
    return (  # CHOICES
        pa.types.is_struct(value)
        and {value.field(i).name for i in range(value.num_fields)} >= {"text", "label"}
        and strings(value.field("text").type)
        and strings(value.field("label").type)
    )


def read_split(task: BenchmarkTask, directory: Path, split: str) -> pa.Table:
    """A split's files as one table, each file's columns checked against what the task reads."""
    import pyarrow as pa
    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    tables = []
    for path in split_files(directory, split):
        try:
            table = pq.read_table(path) if path.suffix == ".parquet" else pa_json.read_json(path)
        except (pa.ArrowException, OSError) as exc:
            raise InputError(f"benchmark {task.name}: {path} does not read ({str(exc).splitlines()[0]})") from None
        wrong = [
            n
            for n, kind in task.data.columns.items()
            if n not in table.schema.names or not _is_kind(kind, table.schema.field(n).type)
        ]
        if wrong:
            expected = ", ".join(f"{n} ({kind})" for n, kind in task.data.columns.items())
            found = ", ".join(f"{field.name} ({field.type})" for field in table.schema)
            raise InputError(
                f"benchmark {task.name}: {path} has the columns {found}; expected {expected}, as the hub's "
                f"{task.data.hub} has them"
            )
        tables.append(table.select(list(task.data.columns)))
    if not tables:
        raise InputError(
            f"benchmark {task.name}: {directory} holds no {split} split: expected {_expected(task, split)}"
        )
    table = pa.concat_tables(tables, promote_options="permissive")
    if table.num_rows == 0:
        raise InputError(f"benchmark {task.name}: the {split} split in {directory} has no rows")
    return table


class _Tables:
    """lm-eval's `custom_dataset`: the task's splits, from tables already read; it is called with the task's metadata
    as keyword arguments, which it does not need."""

    def __init__(self, tables: dict[str, pa.Table]):
        self.tables = tables

    def __call__(self, **_: Any) -> Any:
        import datasets

        return datasets.DatasetDict({split: datasets.Dataset(table) for split, table in self.tables.items()})


def _task_config(task: BenchmarkTask, tables: dict[str, pa.Table]) -> dict[str, Any]:
    """Our overrides of the task's own YAML: our data, the shots, and only the splits there are (lm-eval reads its
    few-shot split, else its validation split, when the task is built, even at 0 shots)."""
    fewshot = task.data.fewshot_split if task.shots else None
    return {
        "task": task.name,
        "custom_dataset": _Tables(tables),
        "num_fewshot": task.shots,
        "training_split": fewshot,
        "validation_split": task.data.eval_split if task.data.eval_split == "validation" else None,
        "test_split": task.data.eval_split if task.data.eval_split == "test" else None,
    }


@contextmanager
def _bootstrap_in_process() -> Iterator[None]:
    """lm-eval bootstraps a stderr (perplexity's) in a multiprocessing pool of every CPU unless DISABLE_MULTIPROC
    is set: forked from a process holding a CUDA context, and for a thousand draws."""
    before = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["DISABLE_MULTIPROC"]
        else:
            os.environ["DISABLE_MULTIPROC"] = before


class _Dropped(logging.Filter):
    """Drops, and counts, a logger's lines that contain `text`."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text, self.count = text, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.text in record.getMessage():
            self.count += 1
            return False
        return True


@contextmanager
def _dropped(logger_name: str, text: str) -> Iterator[_Dropped]:
    dropped, logger = _Dropped(text), logging.getLogger(logger_name)
    logger.addFilter(dropped)
    try:
        yield dropped
    finally:
        logger.removeFilter(dropped)


def load_tasks(tasks: list[BenchmarkTask], data: dict[str, Path]) -> Any:
    """The tasks as lm-eval builds them from its own YAML (its TaskManager's TaskDict), over the tables read from
    `data` (columns checked first), with their few-shot examples drawn with a fixed seed."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    tables = {task.name: {split: read_split(task, data[task.name], split) for split in task.splits()} for task in tasks}
    tasks_dir = Path(lm_eval.tasks.__file__).parent  # indexing only our tasks' directories: 0.1 s, not 6
    manager = TaskManager(
        include_defaults=False, include_path=sorted({tasks_dir / task.data.lm_eval_dir for task in tasks})
    )
    # lm-eval warns, for every task given its data by custom_dataset, that the callable could take more arguments
    with _dropped("lm_eval.api.task", "Custom kwargs can be passed"):
        loaded = manager.load([{"group": _GROUP, "task": [_task_config(task, tables[task.name]) for task in tasks]}])
    for built in loaded["tasks"].values():
        built.set_fewshot_seed(seed=FEWSHOT_SEED)
    return loaded


def run_benchmarks(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    tasks: list[BenchmarkTask],
    data: dict[str, Path],
    batch_size: int,
    device: torch.device | str,
    limit: int | None = None,
    which: str = "the model",
) -> list[BenchmarkResult]:
    """Each task's metrics on `model` (where it is: `device` must be its device), over the first `limit` documents
    of its scored split (all by default), in the order of `tasks`; the log lines name the model as `which` (an
    evaluation scores the checkpoint's, then the starting model).

    lm-eval's HFLM encodes with the tokenizer's own special tokens (its add_bos_token left unset): the snapshot's
    tokenizer puts BOS first, so every context and continuation is scored as a document training saw, [BOS] text;
    a tokenizer without a BOS adds nothing, as training added nothing. Nothing is cached, logged per sample or
    written, and nothing is downloaded. Log-probabilities are taken in fp32 whatever the model's dtype."""
    if not tasks:
        return []  # before lm-eval is imported: 70 MB of the process that an evaluation without benchmarks never needs
    import torch
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    at = next(model.parameters()).device
    if at.type != torch.device(device).type:
        raise ValueError(f"the model is on {at}, not on {device}")
    loaded = load_tasks(tasks, data)
    shas = {task.name: content_sha256(data[task.name]) for task in tasks}
    # HFLM warns, at each model handed to it, that a model in memory takes no loading arguments: none are given
    with (
        _dropped("lm_eval.models.huggingface", "model kwarg is not of type"),
        _dropped("lm_eval.models.huggingface", "already-initialized model"),
    ):
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, softmax_dtype=torch.float32)
    # lm-eval warns once per request longer than the model's positions (it keeps their last tokens): said once here
    with _bootstrap_in_process(), _dropped("lm_eval.models.huggingface", "Combined length of context") as cut:
        out = evaluate(
            lm=lm,
            task_dict=loaded,
            limit=limit,
            bootstrap_iters=BOOTSTRAP_ITERS,
            log_samples=False,
            write_out=False,
            cache_requests=False,
        )
    if cut.count:
        log.warning(
            "%d benchmark request(s) to %s were longer than its %d positions: their first tokens were left out, "
            "as lm-eval does",
            cut.count,
            which,
            lm.max_length,
        )
    results = []
    for task in tasks:
        scores = out["results"][task.name]
        items = out["n-samples"][task.name]["effective"]
        for metric in task.data.metrics:
            stderr = scores.get(f"{metric}_stderr,none")
            results.append(
                BenchmarkResult(
                    task=task.name,
                    metric=metric,
                    value=float(scores[f"{metric},none"]),
                    stderr=float(stderr) if isinstance(stderr, int | float) else None,
                    shots=task.shots,
                    items=items,
                    data_sha256=shas[task.name],
                )
            )
        log.info(
            "benchmark %s of %s (%d-shot, %d items): %s",
            task.name,
            which,
            task.shots,
            items,
            ", ".join(f"{r.metric} {r.value:.4f}" for r in results if r.task == task.name),
        )
    return results

"""Run the compiled pipeline on this machine with kfp.local: same YAML, same components, a directory for FSx."""

from __future__ import annotations

import builtins
import contextlib
import io
import logging
import re
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError, StepFailed
from components.stage_data.sources import DEFAULT_EXCLUDE, LocalSource, select
from trainer.layout import RunPaths

log = logging.getLogger(__name__)


def default_corpus() -> str:
    """A real corpus present on every machine: the standard library's email package, as Python source."""
    return str(Path(sysconfig.get_paths()["stdlib"]) / "email")


@dataclass
class LocalRun:
    run_dir: Path
    artifacts_dir: Path
    seconds: float

    def reports(self) -> dict[str, Path]:
        """What a person opens after a run: the run's own files, and the KFP steps' reports as one pattern (each step
        has its directory under the pipeline's; `ls` lists them)."""
        run = RunPaths(self.run_dir)
        found = {
            "training metrics": run.metrics,
            "checkpoint": run.latest_checkpoint,
            "communication report": run.comms_verification,
            "evaluation report": run.eval_html,
            "run summary": run.summary_report,
        }
        steps = {p.parent.parent for p in self.artifacts_dir.rglob("report") if p.is_file()}
        if len(steps) == 1:  # one pipeline run's directory: <artifacts>/<pipeline run>/<step>/report
            (pipeline_dir,) = steps
            reports = sorted(pipeline_dir.glob("*/report"))
            found[f"KFP step reports ({len(reports)})"] = pipeline_dir / "*" / "report"
        return found


def run_local(pipeline_file: Path, storage_root: Path, arguments: dict[str, Any], verbose: bool = False) -> LocalRun:
    if not pipeline_file.is_file():
        raise InputError(f"pipeline file {pipeline_file}: no such file (run 'hyperpod-pretrain compile')")
    check_before_start(storage_root, arguments)  # before kfp and torch load: bad input is refused in a second

    import kfp.local
    from kfp import components

    from components.stage_data.core import prepare_storage_root

    prepare_storage_root(str(storage_root))
    storage_root = storage_root.resolve()
    if KFP_LOCAL_REWRITES in str(storage_root):
        raise InputError(
            f"storage root {storage_root}: kfp.local corrupts arguments that contain "
            f"{KFP_LOCAL_REWRITES!r}; choose a directory whose path does not"
        )
    arguments = {**arguments, "source": safe_source(arguments["source"], storage_root)}
    if arguments.get("mixture"):
        arguments["mixture"] = [
            dict(e, source=safe_source(str(e.get("source") or ""), storage_root)) for e in arguments["mixture"]
        ]
    run_id = arguments["run_id"]
    pipeline_root = storage_root / "kfp-local" / run_id
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root))
    pipeline = components.load_component_from_text(without_retries(pipeline_file.read_text()))
    started = time.monotonic()
    with warnings.catch_warnings():
        # kfp.local warns that our components image is not a python image: locally it runs in this venv.
        warnings.filterwarnings("ignore", message=".*non-Python base image.*", category=RuntimeWarning)
        # ...and, once per step, that the step's CPU and memory limits and timeout mean nothing here
        # (kfp/local/orchestrator/task_executor.py, _warn_local_only_noops): true of every step, said once here.
        warnings.filterwarnings("ignore", message=r"Task '.*': settings \[.*", category=UserWarning)
        log.info(
            "kfp.local ignores each step's CPU and memory limits and timeout; each step runs once (the "
            "pipeline's retries are for a pod lost on the cluster)"
        )
        try:
            with quiet_console(verbose):
                pipeline(**arguments, storage_root=str(storage_root))
        except RuntimeError as exc:
            reason, on_input = failed_step_reason(RunPaths.of(storage_root, run_id))
            message = f"local pipeline run {run_id} failed: {reason or ANSI_ESCAPE.sub('', str(exc)).splitlines()[0]}"
            raise (InputError if on_input else StepFailed)(message) from None  # the step's exit code: 2 or 1
    return LocalRun(RunPaths.of(storage_root, run_id).root, pipeline_root, time.monotonic() - started)


def without_retries(pipeline_yaml: str) -> str:
    """The compiled pipeline less its steps' retry policies. kfp 2.17's local runner honours them
    (kfp/local/orchestrator/task_executor.py: up to 2 retries after 10 s and 20 s), and neither it nor KFP retries
    on some exit codes only: a step refused on its input (exit 2) would run three times. They are there for a pod
    lost on the cluster (a node gone, an eviction), which a local run has not."""
    import yaml

    documents = list(yaml.safe_load_all(pipeline_yaml))
    spec = documents[0]
    for dag in [spec["root"].get("dag", {}), *(c.get("dag", {}) for c in spec.get("components", {}).values())]:
        for task in dag.get("tasks", {}).values():
            task.pop("retryPolicy", None)
    return "\n---\n".join(yaml.safe_dump(d, sort_keys=False) for d in documents)


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# What a person follows a local run by (the rest is behind --verbose): kfp.local's line at each step's end and the
# pipeline's; the steps' own log lines at WARNING and above, and at INFO those of staging and of the trainer's rank 0
# (relayed by the local backend); a traceback's lines.
KFP_PROGRESS = re.compile(
    r" - (INFO - (Task .* finished with status|Pipeline .* finished with status|Running "
    r"pipeline)|WARNING - |ERROR - )"
)
STEP_LOG = re.compile(r"^\s*\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[A-Z]+) (?P<name>[\w.]+): (?P<text>.*)$")
KEPT_LOGGERS = ("components.stage_data", "pipelines.")
TRAINER_RANK_0 = re.compile(r"\[default0\]:.* \[rank 0\] (INFO|WARNING|ERROR) trainer")
RELAYED = re.compile(
    r"^\[default\d+\]:\d{4}-\d\d-\d\d (?P<time>\d\d:\d\d:\d\d),\d+ \[rank \d+\] (?P<level>[A-Z]+) "
    r"[\w.]+: (?P<text>.*)$"
)


def shown(line: str) -> str:
    """A kept line as the quiet console shows it: one time (a step's log line carries its logger's and the trainer's
    relayed one its own too), the level only when it is not INFO, no logger names."""
    step = STEP_LOG.match(line)
    if step is None:
        return line
    time, text, level = step.group(0).split()[1][:8], step.group("text"), step.group("level")
    if relayed := RELAYED.match(text):
        time, text, level = relayed.group("time"), relayed.group("text"), relayed.group("level")
    return f"    {time} {'' if level == 'INFO' else level + ' '}{text}"


def keep_line(line: str) -> bool:
    """Whether a line of kfp.local's output is one a person follows the run by (quiet_console)."""
    if KFP_PROGRESS.search(line):
        return True
    step = STEP_LOG.match(line)
    if step is None:  # kfp.local's separators and dumps of inputs and outputs; a traceback's lines are kept
        return line.lstrip().startswith(("Traceback", 'File "')) or bool(EXCEPTION_LINE.match(line))
    level, name, text = step.group("level", "name", "text")
    if level in ("WARNING", "ERROR", "CRITICAL"):
        return True
    if name.startswith("components.launch_training.local_backend"):
        return bool(TRAINER_RANK_0.search(text)) or text.startswith("launching")
    return name.startswith(KEPT_LOGGERS)


EXCEPTION_LINE = re.compile(r"\s*[\w.]+(Error|Exception)\b")  # a traceback's last line: common.errors.InputError: ...
INPUT_ERROR = re.compile(r"\s*(common\.errors\.)?InputError\b")


class LineFilter(io.TextIOBase):
    """A stdout that writes whole lines `keep` accepts, with terminal colours removed when it is not a terminal. With
    `hide_bad_input`, a traceback that ends in an InputError is not shown: a step refused on its input says why in
    one line, which run-local's own last line repeats."""

    def __init__(self, out: Any, keep: Any, show: Any = lambda line: line, hide_bad_input: bool = False) -> None:
        self.out, self.keep, self.show, self.pending = out, keep, show, ""
        self.colour = bool(getattr(out, "isatty", lambda: False)())
        self.hide_bad_input = hide_bad_input
        self.traceback: list[str] | None = None  # the lines of a traceback held until its last one

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            plain = ANSI_ESCAPE.sub("", line)
            if self.hide_bad_input and plain.lstrip().startswith("Traceback"):
                self._release()  # one left unfinished
                self.traceback = []
            if self.traceback is not None:
                if STEP_LOG.match(plain) or KFP_PROGRESS.search(plain):
                    self._release()  # the traceback ended without its exception line: shown as it was
                else:
                    self.traceback.append(line)
                    if EXCEPTION_LINE.match(plain):
                        held, self.traceback = self.traceback, None
                        if not INPUT_ERROR.match(plain):
                            self._emit(held)
                    continue
            self._emit([line])
        return len(text)

    def _release(self) -> None:
        held, self.traceback = self.traceback or [], None
        self._emit(held)

    def _emit(self, lines: list[str]) -> None:
        for line in lines:
            plain = ANSI_ESCAPE.sub("", line)
            if self.keep(plain):
                self.out.write(self.show(line if self.colour else plain) + "\n")

    def flush(self) -> None:
        self.out.flush()

    def finish(self) -> None:
        """Show a traceback left unfinished (a step killed while printing it)."""
        self._release()
        self.out.flush()


@contextlib.contextmanager
def quiet_console(verbose: bool) -> Any:
    """kfp.local prints each step's whole executor input and outputs (hundreds of lines for a short run): only what
    `keep_line` accepts reaches the console, unless `verbose`. Installed before kfp.local's logger takes sys.stdout."""
    real, real_print = sys.stdout, builtins.print
    console = LineFilter(real, lambda line: True) if verbose else LineFilter(real, keep_line, shown, True)
    sys.stdout = console
    # kfp.local swaps the root logger's handlers per task; with parallel tasks one may log through ours meanwhile
    plain = KfpRecords(colour=bool(getattr(real, "isatty", lambda: False)()), quiet=not verbose)
    logging.getLogger().addFilter(plain)
    try:
        yield
    finally:
        console.finish()
        sys.stdout = real
        logging.getLogger().removeFilter(plain)
        # kfp.local indents a task's prints by replacing builtins.print for the task and putting back the one it
        # found (kfp/local/logging_utils.py, indented_print): two tasks in parallel (the tokenize fan-out) can leave
        # the first's indenting print in place, and every later print indented.
        builtins.print = real_print


class KfpRecords(logging.Filter):
    """kfp.local's own log records, whichever handler they reach: without colour codes for a console that is not a
    terminal, and when quiet only those keep_line keeps (its step-end and pipeline lines)."""

    def __init__(self, colour: bool, quiet: bool) -> None:
        super().__init__()
        self.colour, self.quiet = colour, quiet

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "root":  # ours, and the components': kfp.local logs on the root logger
            return True
        message = ANSI_ESCAPE.sub("", record.getMessage())
        if self.quiet and not KFP_PROGRESS.search(f" - {record.levelname} - {message}"):
            return False
        if not self.colour:
            record.msg, record.args = message, ()
        return True


def failed_step_reason(run: RunPaths) -> tuple[str, bool]:
    """The failed step's own reason, from the summary the exit step wrote, rather than kfp.local's "Inner task failed:
    'launch-pytorchjob' inside 'exit-handler-1'" (coloured, even into a file); and whether it failed on its input
    (its record says so: the step exited 2)."""
    import json

    try:
        steps = json.loads(run.summary.read_text()).get("steps") or []
    except (OSError, ValueError, AttributeError):
        return "", False
    failed = [s for s in steps if isinstance(s, dict) and s.get("state") == "failed" and s.get("error")]
    if not failed:
        return "", False
    error = ANSI_ESCAPE.sub("", str(failed[0]["error"])).strip().splitlines()  # its first line is its summary
    return f"step {failed[0].get('step', '?')} failed: {error[0] if error else ''}", bool(failed[0].get("permanent"))


def check_before_start(storage_root: Path, arguments: dict[str, Any]) -> None:
    """What can be checked before anything is staged or written, each failing with one line (exit 2): the training
    settings as the launcher will check them, the evaluate step's checkpoints, the source and the files its filters
    select, a tokenizer to stage with, the resumed run's checkpoint, a dataset to skip staging of."""
    from components.launch_training.config import TRAIN_SETTINGS, LaunchConfig
    from trainer.layout import DatasetPaths

    run_id = arguments["resume_run_id"] or arguments["run_id"]
    config = LaunchConfig(
        storage_root=str(storage_root),
        dataset=arguments["dataset"],
        run_id=run_id,
        init_from_run_id=arguments.get("init_from_run_id", ""),
        init_from_model=checked_model(arguments.get("init_from_model", "")),
        resume=bool(arguments["resume_run_id"]),
        s3_endpoint_url=arguments.get("s3_endpoint_url", ""),
        checkpoint_s3_uri=arguments.get("checkpoint_s3_uri", ""),
        nproc_per_node=arguments.get("nproc_per_node", 2),
        train={k: arguments[k] for k in TRAIN_SETTINGS if k in arguments},
    )
    config.validate(check_storage=False)
    check_eval_checkpoints(arguments.get("eval_checkpoints", "latest"))
    if arguments.get("mixture"):
        check_mixture_before_start(storage_root, arguments)
        return
    source = str(arguments["source"])
    if not arguments.get("skip_staging"):  # staging's own checks of its settings
        from components.stage_data.settings import StageSettings

        staging = {k: v for k, v in arguments.items() if k in StageSettings.__dataclass_fields__}
        StageSettings.of_step(
            storage_root=str(storage_root), tokenize_groups=arguments.get("tokenize_workers", 1), **staging
        ).check()
    if not arguments.get("skip_staging"):
        check_local_source(source, "source", arguments)
    tokenizer = str(arguments.get("tokenizer_path") or "")
    if tokenizer and not tokenizer.startswith("s3://") and not Path(tokenizer).exists():
        raise InputError(f"tokenizer_path {tokenizer}: no such file or directory")
    if arguments.get("skip_staging") and not DatasetPaths.of(storage_root, arguments["dataset"]).current.is_file():
        raise InputError(f"skip_staging: dataset {arguments['dataset']!r} was never staged under {storage_root}")
    if config.resume and not config.run_paths.has_checkpoint() and not config.checkpoint_s3_uri:
        raise InputError(
            f"resume_run_id {run_id!r}: {config.run_paths.checkpoints} holds no checkpoint to continue from"
        )


def check_eval_checkpoints(checkpoints: str) -> None:
    """The evaluate step's checkpoints, refused before training rather than after it."""
    from components.evaluate_checkpoint.inputs import check_checkpoints

    try:
        check_checkpoints(checkpoints)
    except InputError as exc:
        raise InputError(f"eval_checkpoints: {exc}") from None


def check_mixture_before_start(storage_root: Path, arguments: dict[str, Any]) -> None:
    """A mixture's entries (components/stage_data/mixture.py): each local source there with files its filters keep,
    each entry without one staged before."""
    from components.stage_data.mixture import mixture_sources
    from trainer.layout import DatasetPaths

    for entry in mixture_sources(arguments["mixture"]):
        if entry.source and not arguments.get("skip_staging"):
            check_local_source(entry.source, f"mixture source of {entry.dataset!r},", arguments)
        elif not DatasetPaths.of(storage_root, entry.dataset).current.is_file():
            raise InputError(
                f"mixture: dataset {entry.dataset!r} has no source and was never staged under "
                f"{storage_root}: give its source (--mixture-source {entry.dataset}=PATH)"
            )


def checked_model(model: str) -> str:
    """init_from_model, a directory checked now as the trainer reads it (an s3:// prefix is copied onto the volume
    and checked by staging)."""
    if model and not model.startswith("s3://"):
        from components.stage_data.models import published_model

        published_model(model, storage_root="")
    return model


def check_local_source(source: str, what: str, arguments: dict[str, Any]) -> None:
    """A local source (not s3://) that is there and has files the run's filters keep; `what` names it."""
    if source.startswith("s3://"):
        return
    if not Path(source.removeprefix("file://")).exists():
        raise InputError(f"{what} {source}: no such file or directory")
    check_selection(source, arguments.get("include", ["*"]), arguments.get("exclude", DEFAULT_EXCLUDE))


def check_selection(source: str, include: list[str], exclude: list[str] | tuple[str, ...]) -> None:
    """A local source whose filters keep no file (a corpus of .txt files under the demo's '*.py') is refused now, in
    staging's own words, rather than after the pipeline's first half-minute: the listing and the filters are
    staging's (LocalSource, select), so the two cannot disagree."""
    select(LocalSource(source).list(), source, tuple(include), tuple(exclude))


# kfp.local's SubprocessRunner replaces this string in every argument of a task's command (it means
# to swap the interpreter), so a parameter value containing it arrives corrupted.
KFP_LOCAL_REWRITES = "python3"


def safe_source(source: str, storage_root: Path) -> str:
    """A path to the same source that kfp.local passes through intact: a symlink under the storage root."""
    if KFP_LOCAL_REWRITES not in source:
        return source
    target = Path(source.removeprefix("file://")).resolve()
    if not target.exists():
        raise InputError(f"source {source}: does not exist")
    alias = storage_root / "sources" / target.name
    alias.parent.mkdir(parents=True, exist_ok=True)
    if alias.is_symlink() and alias.resolve() != target:
        alias.unlink()
    if not alias.is_symlink():
        alias.symlink_to(target)
    log.info("passing source %s as %s (kfp.local rewrites %r inside arguments)", source, alias, KFP_LOCAL_REWRITES)
    return str(alias)


def new_run_id() -> str:
    return time.strftime("local-%Y%m%d-%H%M%S", time.gmtime())

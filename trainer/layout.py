"""The storage layout on the shared FSx volume: the one contract between the pipeline's steps.

Every step, the trainer included, finds its files through these classes and nowhere else:

    <root>/datasets/<dataset>/raw/...                mirror of the source
    <root>/datasets/<dataset>/staging_manifest.json  key, size, ETag or sha256 per file; written last
    <root>/datasets/<dataset>/val_set.json           the val split's files, chosen once and kept across snapshots
    <root>/datasets/<dataset>/snapshots/<id>/        a tokenized snapshot, never changed once written: tokenizer.json,
                                                     train_*.bin, val_*.bin, meta.json; <id> is a hash of its inputs
    <root>/datasets/<dataset>/current.json           which snapshot the latest staging produced
    <root>/models/<name>/raw/...                     a published model copied from S3 (init_from_model): config.json,
                                                     safetensors, tokenizer; mirrored as a corpus is, with its
                                                     manifest, so the next run copies nothing
    <root>/runs/<run_id>/config.json                 resolved trainer config
    <root>/runs/<run_id>/checkpoints/step_<N>/       a committed checkpoint; checkpoint_latest links the newest
    <root>/runs/<run_id>/metrics.jsonl               one JSON object per logged step
    <root>/runs/<run_id>/status.json                 the trainer's state: running, done, preempted, crashed
    <root>/runs/<run_id>/logs/ nccl/ comms/          per-rank logs, NCCL_DEBUG_FILE output and comms self-test (per
                                                     attempt: attempt-NNNN/)
    <root>/runs/<run_id>/eval/step_<N>/              one checkpoint's evaluation: eval.json, report.md, report.html
    <root>/runs/<run_id>/eval/history.jsonl          one line per evaluation, in the order they ran
    <root>/runs/<run_id>/eval/eval.json report.*     the newest step's evaluation, copied: where readers look first
    <root>/runs/<run_id>/steps/<step>.json           each pipeline step's outcome, written as it ends
    <root>/runs/<run_id>/summary.json summary.md     the run summary, written by the pipeline's exit step

It lives in the trainer package because the trainer image ships only that package.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

META = "meta.json"  # in every snapshot: what the trainer and the evaluation read first
TOKENIZER = "tokenizer.json"
# A run's checkpoints (trainer/checkpoint.py): one directory per committed step, complete when its commit file is
# there; checkpoint_latest is a symbolic link to the newest.
CHECKPOINT_STEP_DIR = re.compile(r"^step_(\d{8})$")
CHECKPOINT_COMMIT = "commit.json"
CHECKPOINT_LATEST = "checkpoint_latest"
EVAL_STEP_DIR = CHECKPOINT_STEP_DIR  # eval/step_<N>/: named as the checkpoint it measured
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(kind: str, value: str) -> str:
    """Dataset names and run ids become directory names: refuse anything that could escape or collide."""
    if not _NAME.match(value or "") or value in (".", ".."):
        raise ValueError(
            f"{kind} {value!r} is not a valid name: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class MirrorPaths:
    """A mirror of S3 objects or local files on the volume (components/stage_data/mirror.py): a dataset's source,
    or a published model's files."""

    root: Path

    @property
    def raw(self) -> Path:
        return self.root / "raw"

    @property
    def manifest(self) -> Path:
        return self.root / "staging_manifest.json"

    @property
    def staging_journal(self) -> Path:
        """The objects an unfinished staging run has landed: the next run does not copy them again."""
        return self.root / ".staging_journal.jsonl"

    @property
    def staging_lock(self) -> Path:
        """Held (flock) by the staging run of this mirror: two runs never stage it at once."""
        return self.root / ".staging.lock"


@dataclass(frozen=True)
class DatasetPaths(MirrorPaths):
    @classmethod
    def of(cls, storage_root: str | Path, dataset: str) -> DatasetPaths:
        return cls(Path(storage_root) / "datasets" / check_name("dataset", dataset))

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def val_set(self) -> Path:
        """The val split's keys, chosen at the first staging and kept, so evaluations compare on the same text."""
        return self.root / "val_set.json"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    def snapshot(self, snapshot_id: str) -> Path:
        return self.snapshots / check_name("snapshot", snapshot_id)

    @property
    def current(self) -> Path:
        """The pointer to the newest snapshot: {"snapshot": id}, replaced atomically by staging."""
        return self.root / "current.json"

    @property
    def legacy_tokenized(self) -> Path:
        """Where datasets staged before snapshots keep their shards (one directory, replaced on re-staging)."""
        return self.root / "tokenized"

    def current_snapshot(self) -> Path | None:
        """The directory of the snapshot `current.json` names (or of a dataset staged before snapshots), or None."""
        try:
            return self.snapshot(json.loads(self.current.read_text())["snapshot"])
        except FileNotFoundError:
            return self.legacy_tokenized if (self.legacy_tokenized / META).is_file() else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.current} is unreadable ({exc}): stage dataset {self.name!r} again") from None

    def resolve_snapshot(self, snapshot_id: str = "") -> Path | None:
        """A snapshot's directory by id; "" for the current one; "tokenized" for a dataset staged before snapshots."""
        if not snapshot_id:
            return self.current_snapshot()
        if snapshot_id == self.legacy_tokenized.name:
            return self.legacy_tokenized
        return self.snapshot(snapshot_id)


def dataset_of_snapshot(snapshot_dir: str | Path) -> DatasetPaths:
    """The dataset a snapshot directory (or a pre-snapshot tokenized/ directory) belongs to."""
    snapshot_dir = Path(snapshot_dir)
    parent = snapshot_dir.parent
    return DatasetPaths(parent.parent if parent.name == "snapshots" else parent)


@dataclass(frozen=True)
class ModelPaths(MirrorPaths):
    """A published model copied from S3, mirrored as a dataset's source is: its files under raw/ (the directory the
    trainer reads), the manifest of their sizes and ETags, the journal of an interrupted copy, the lock two runs
    copying it share."""

    @classmethod
    def of(cls, storage_root: str | Path, uri: str) -> ModelPaths:
        """Named after the prefix's last part, and a digest of the whole URI: two prefixes never share a copy."""
        uri = uri.rstrip("/")
        tail = re.sub(r"[^A-Za-z0-9._-]", "-", uri.rsplit("/", 1)[-1])[:64].lstrip(".-_") or "model"
        digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
        return cls(Path(storage_root) / "models" / f"{tail}-{digest}")

    @classmethod
    def copy_holding(cls, directory: Path) -> ModelPaths | None:
        """The copy whose files `directory` is (its raw/, with a manifest beside), or None: a model given as a
        directory of its own."""
        paths = cls(directory.parent)
        return paths if directory.name == paths.raw.name and paths.manifest.is_file() else None


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @classmethod
    def of(cls, storage_root: str | Path, run_id: str) -> RunPaths:
        return cls(Path(storage_root) / "runs" / check_name("run id", run_id))

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest_checkpoint(self) -> Path:
        """The link to the newest committed checkpoint directory (trainer/checkpoint.py), or a run's single file
        from before sharded checkpoints."""
        link, single_file = self.checkpoints / CHECKPOINT_LATEST, self.checkpoints / "checkpoint_latest.pt"
        return single_file if single_file.exists() and not link.exists() else link

    def has_checkpoint(self) -> bool:
        """Whether a committed checkpoint is there to resume from or start another run from."""
        return any(self.checkpoints.glob(f"step_*/{CHECKPOINT_COMMIT}")) or any(
            self.checkpoints.glob("checkpoint_step_*.pt")
        )

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard's event files, rank 0's and the evaluation step's (trainer/tracking.py)."""
        return self.root / "tensorboard"

    @property
    def mlflow_run(self) -> Path:
        """The run's MLflow run (tracking URI, experiment, run id, URL), when it has one."""
        return self.root / "mlflow.json"

    @property
    def status(self) -> Path:
        """The trainer's last word: running, done, preempted (and whether its checkpoint was committed), crashed."""
        return self.root / "status.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def nccl(self) -> Path:
        return self.root / "nccl"

    @property
    def comms(self) -> Path:
        return self.root / "comms"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def comms_verification(self) -> Path:
        return self.comms / "verification.md"

    @property
    def eval_result(self) -> Path:
        """The evaluation of the newest evaluated step (a copy of its eval/step_<N>/eval.json): evaluating an older
        checkpoint afterwards leaves it be, so readers of this one path always see the run's furthest result."""
        return self.eval / "eval.json"

    @property
    def eval_report(self) -> Path:
        """The newest evaluated step's Markdown report, beside eval_result."""
        return self.eval / "report.md"

    @property
    def eval_html(self) -> Path:
        """The newest evaluated step's HTML report, beside eval_result."""
        return self.eval / "report.html"

    def eval_step(self, step: int) -> Path:
        """One checkpoint's evaluation (eval.json, report.md, report.html): evaluations of other steps never touch
        it; evaluating the same step again replaces it."""
        return self.eval / f"step_{step:08d}"

    def eval_steps(self) -> list[int]:
        """The steps evaluated (each with its eval.json under eval/step_<N>/), oldest first."""
        found = (EVAL_STEP_DIR.match(p.parent.name) for p in self.eval.glob("step_*/eval.json"))
        return sorted(int(m.group(1)) for m in found if m)

    @property
    def eval_history(self) -> Path:
        """One JSON line per evaluation, in the order they ran: step, time, val loss, bits per byte, gate verdict."""
        return self.eval / "history.jsonl"

    @property
    def eval_lock(self) -> Path:
        """Held (flock) while an evaluation writes its files, the history and the newest-step copies: two
        evaluations of one run never interleave them."""
        return self.eval / ".lock"

    @property
    def steps(self) -> Path:
        return self.root / "steps"

    def step_record(self, step: str) -> Path:
        return self.steps / f"{step}.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def summary_report(self) -> Path:
        return self.root / "summary.md"

    def attempt(self, attempt: int) -> str:
        """An attempt's directory name under comms/ and nccl/: each start of the trainer (a torchrun restart, an
        elastic resize, a pod or job restarted) is one, numbered by rank 0 and agreed on by every rank."""
        return f"attempt-{attempt:04d}"

    def attempts(self) -> list[int]:
        """The attempts the run's comms/ holds, oldest first (none: a run from before attempts)."""
        found = (p.name.removeprefix("attempt-") for p in self.comms.glob("attempt-*") if p.is_dir())
        return sorted(int(n) for n in found if n.isdigit())

    def comms_report(self, rank: int, attempt: int = 0) -> Path:
        """Rank `rank`'s self-test report of `attempt` (0: the layout of runs from before attempts)."""
        directory = self.comms / self.attempt(attempt) if attempt else self.comms
        return directory / f"rank_{rank:05d}.json"

    def nccl_dir(self, attempt: int = 0) -> Path:
        return self.nccl / self.attempt(attempt) if attempt else self.nccl

    @property
    def compile_cache(self) -> Path:
        """torch.compile's cache (TORCHINDUCTOR_CACHE_DIR): a restarted pod loads the compiled code from here."""
        return self.root / "cache" / "inductor"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank_{rank:05d}.log"

"""A data mixture: several staged datasets, each global batch's sequences drawn from them in proportion to weights.

Which dataset the sequence at global position g comes from (g counts the sequences of all ranks, as DataPosition's
offset does) is a function of g and the seed alone: the point u_g = g * phi + h(seed) mod 2^64, a Weyl sequence with
the golden ratio's step, falls in one of the intervals that cut [0, 2^64) in the weights' proportions. That sequence
is as evenly spread as any can be (its discrepancy grows as log g), so over any n consecutive positions each dataset's
count is within a few sequences of n * share; no index is built, nothing is drawn, and the choice costs O(1) memory
however long the run. Rank r takes its slice of each global batch, as from a single dataset, so the order is the same
for any world size.

Within a dataset, its k-th sequence is window (k mod windows) of epoch k // windows in that dataset's own keyed
permutation (trainer/data.py WindowOrder, keyed by the seed and the dataset's name): a dataset smaller than its share
repeats in a new shuffled epoch, counted. The position is the global offset and each dataset's count: restored from a
checkpoint it replays nothing and skips nothing; the weights are saved with it, and an exact resume with others is
refused (a warm start, a new run, may change them).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.data import MIXTURE_ORDER, TokenSplit, WindowOrder
from trainer.errors import DataError

if TYPE_CHECKING:
    import torch

WEYL_STEP = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd: the Weyl sequence's step


@dataclass(frozen=True)
class MixtureEntry:
    """One dataset of a mixture: its directory (a snapshot's, or a dataset's for its current one) and weight."""

    name: str
    directory: Path
    weight: float


def parse_weights(text: str, what: str = "--mixture") -> list[tuple[str, float]]:
    """The text web=0.8,code=0.2 as [(key, weight)], checked: numbers, none negative, not all zero, no key twice.
    ValueError says what is wrong, naming `what`."""
    entries: list[tuple[str, float]] = []
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.rpartition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: {part!r} is not DATASET=WEIGHT (e.g. web=0.8,code=0.2)")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"{what}: the weight of {key.strip()!r}, {value!r}, is not a number") from None
        entries.append((key.strip(), weight))
    check_weights(entries, what)
    return entries


def check_weights(entries: Sequence[tuple[str, float]], what: str = "--mixture") -> None:
    if not entries:
        raise ValueError(f"{what} names no dataset")
    seen: set[str] = set()
    for key, weight in entries:
        if key in seen:
            raise ValueError(f"{what}: dataset {key!r} is named twice")
        seen.add(key)
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{what}: the weight of {key!r} is {weight}: weights are numbers of 0 or more")
    if not sum(w for _, w in entries) > 0:
        raise ValueError(f"{what}: every weight is 0: give at least one dataset a positive weight")


def entry_weights(entries: Sequence[Any], optional: set[str]) -> list[tuple[str, float]]:
    """A mixture as the pipeline and the launcher take it, [{dataset, weight, <optional keys>}], checked as
    parse_weights checks its text: [(dataset, weight)]; ValueError says what is wrong, in one line."""
    keys = "{dataset, weight" + "".join(f", {k}?" for k in sorted(optional)) + "}"
    pairs = []
    for entry in entries:
        if not isinstance(entry, dict) or not {"dataset", "weight"} <= set(entry) <= {"dataset", "weight", *optional}:
            raise ValueError(f"mixture: {entry!r} is not {keys}")
        weight = entry["weight"]
        try:
            if isinstance(weight, bool):
                raise ValueError
            pairs.append((str(entry["dataset"]), float(weight)))
        except (TypeError, ValueError):
            raise ValueError(f"mixture: the weight of {entry['dataset']!r}, {weight!r}, is not a number") from None
    check_weights(pairs, "mixture")
    return pairs


def one_tokenizer(tokenizers: dict[str, str], what: str, remedy: str) -> None:
    """Every dataset of a mixture staged with the first's tokenizer (`tokenizers`: dataset -> tokenizer sha256), or
    DataError naming the first that is not: their token ids would mean other strings."""
    first = next(iter(tokenizers))
    for name, digest in tokenizers.items():
        if digest != tokenizers[first]:
            raise DataError(
                f"{what}: dataset {name!r} was staged with another tokenizer than {first!r} (sha256 "
                f"{digest[:12]} vs {tokenizers[first][:12]}): {remedy}"
            )


def shares(weights: Sequence[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


class DatasetChoice:
    """The dataset index of each global position: the Weyl point's interval among the weights' cuts."""

    def __init__(self, weights: Sequence[float], seed: int):
        cumulative = np.cumsum(shares(weights))[:-1]
        self.cuts = np.array([min(int(c * 2**64), 2**64 - 1) for c in cumulative], dtype=np.uint64)
        digest = hashlib.blake2b(f"{MIXTURE_ORDER}/{seed}".encode(), digest_size=8).digest()
        self.phase = np.uint64(int.from_bytes(digest))

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # arithmetic mod 2^64 is the point
            points = np.asarray(positions, dtype=np.uint64) * np.uint64(WEYL_STEP) + self.phase
        return np.searchsorted(self.cuts, points, side="right")


@dataclass
class MixturePosition:
    """Where a mixture's order stands: the global offset, and how many sequences each dataset has given."""

    weights: dict[str, float]
    offset: int = 0
    consumed: dict[str, int] = field(default_factory=dict)

    def copy(self) -> MixturePosition:
        return MixturePosition(dict(self.weights), self.offset, dict(self.consumed))

    def assign(self, other: MixturePosition) -> None:
        self.offset, self.consumed = other.offset, dict(other.consumed)

    def where(self) -> str:
        return f"sequence {self.offset} of the mixture"

    def state_dict(self) -> dict[str, Any]:
        return {
            "order": MIXTURE_ORDER,
            "offset": self.offset,
            "consumed": dict(self.consumed),
            "weights": dict(self.weights),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("order") != MIXTURE_ORDER:
            raise DataError(
                "--mixture: this run trained on one dataset, not a mixture; an exact resume keeps its "
                "data: resume without --mixture, or start a new run from its weights "
                "(--init-from)"
            )
        if list(state["weights"].items()) != list(self.weights.items()):  # in order: the order cuts the intervals
            raise DataError(
                f"--mixture {describe_weights(self.weights)} differs from the mixture this run trained "
                f"on ({describe_weights(state['weights'])}); an exact resume keeps its mixture: resume "
                "with it, or start a new run from this one's weights (--init-from) with the new "
                "weights"
            )
        self.offset, self.consumed = int(state["offset"]), {k: int(v) for k, v in state["consumed"].items()}


def describe_weights(weights: dict[str, float]) -> str:
    return ",".join(f"{name}={weight:g}" for name, weight in weights.items())


AHEAD = 32  # global batches a rank plans at once


@dataclass
class _Plan:
    """This rank's sequences of AHEAD global batches from `offset`: each batch's rows and each dataset's count in it,
    and the counts before it (a position elsewhere, or restored with other counts, gets a plan of its own)."""

    offset: int
    global_batch: int
    before: np.ndarray  # [batch, dataset]: sequences each dataset had given before the batch
    counts: np.ndarray  # [batch, dataset]: sequences each dataset gives in the batch
    rows: np.ndarray  # [batch, row, (dataset index, window id)]

    def holds(self, offset: int, counted: np.ndarray) -> bool:
        batch, within = divmod(offset - self.offset, self.global_batch)
        return 0 <= batch < len(self.rows) and within == 0 and np.array_equal(self.before[batch], counted)


class MixtureBatches:
    """Yields this rank's micro-batches of a mixture, advancing a MixturePosition; the interface of
    trainer/data.py TokenBatches (the loop and the prefetcher do not know which they read)."""

    def __init__(
        self,
        names: Sequence[str],
        splits: Sequence[TokenSplit],
        weights: Sequence[float],
        seq_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
    ):
        self.names, self.splits, self.weights = list(names), list(splits), list(weights)
        self.seq_len, self.batch_size, self.rank, self.world_size, self.seed = (
            seq_len,
            batch_size,
            rank,
            world_size,
            seed,
        )
        self.global_batch = batch_size * world_size
        self.windows_of = [split.num_windows(seq_len) for split in self.splits]
        for name, split, windows, weight in zip(self.names, self.splits, self.windows_of, self.weights, strict=True):
            if weight > 0 and windows == 0:
                raise DataError(
                    f"--mixture: dataset {name!r}'s {split.name} split has {len(split)} tokens, not one "
                    f"window of {seq_len + 1} tokens in a shard: use a shorter --seq-len, or leave it "
                    "out"
                )
        self.choice = DatasetChoice(self.weights, seed)
        self.position = MixturePosition(
            dict(zip(self.names, self.weights, strict=True)), 0, dict.fromkeys(self.names, 0)
        )
        self.last_windows = np.empty((0, 2), dtype=np.int64)  # (dataset index, window id) of the latest batch
        self._orders: dict[tuple[int, int], WindowOrder] = {}
        self._plan: _Plan | None = None

    @property
    def train_tokens(self) -> int:
        return sum(len(split) for split in self.splits)

    def order(self, dataset: int, epoch: int) -> WindowOrder:
        key = (dataset, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.names):  # an epoch's order is used until the next: keep few
                self._orders.clear()
            self._orders[key] = WindowOrder(self.windows_of[dataset], f"{self.seed}/{self.names[dataset]}", epoch)
        return self._orders[key]

    def take(self, pos: MixturePosition) -> np.ndarray:
        """(dataset index, window id) of each of this rank's sequences at `pos`, advancing `pos` past the global
        batch. Planned AHEAD global batches at a time (numpy's cost per call, spread over them)."""
        counted = np.array([pos.consumed[name] for name in self.names], dtype=np.int64)
        plan = self._plan
        if plan is None or not plan.holds(pos.offset, counted):
            plan = self._plan = self.plan(pos.offset, counted)
        batch = (pos.offset - plan.offset) // self.global_batch
        for name, count in zip(self.names, plan.counts[batch].tolist(), strict=True):
            pos.consumed[name] += count
        pos.offset += self.global_batch
        return plan.rows[batch].copy()

    def plan(self, offset: int, counted: np.ndarray) -> _Plan:
        """This rank's sequences of the AHEAD global batches from `offset`, where each dataset has given `counted`
        sequences: every rank walks all their choices (to count each dataset's) and keeps its slices."""
        picks = self.choice(np.arange(offset, offset + AHEAD * self.global_batch))
        number = np.empty(len(picks), dtype=np.int64)  # at each slot: which sequence of its dataset it is
        for k in range(len(self.names)):
            chosen = picks == k
            number[chosen] = counted[k] + np.arange(int(chosen.sum()))
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        picks_mine = picks.reshape(AHEAD, self.global_batch)[:, mine]
        number_mine = number.reshape(AHEAD, self.global_batch)[:, mine]
        rows = np.empty((AHEAD, self.batch_size, 2), dtype=np.int64)
        rows[..., 0] = picks_mine
        for k in np.unique(picks_mine).tolist():
            at = picks_mine == k
            epochs, within = np.divmod(number_mine[at], self.windows_of[k])
            ids = np.empty(len(within), dtype=np.int64)
            for epoch in np.unique(epochs).tolist():
                ids[epochs == epoch] = self.order(k, epoch)(within[epochs == epoch])
            rows[..., 1][at] = ids
        counts = np.stack(
            [np.bincount(batch, minlength=len(self.names)) for batch in picks.reshape(AHEAD, self.global_batch)]
        )
        return _Plan(offset, self.global_batch, counted + np.cumsum(counts, axis=0) - counts, counts, rows)

    def read(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The tokens of the sequences `take` chose, into `out` (batch_size x seq_len + 1)."""
        for k in np.unique(rows[:, 0]).tolist():
            at = np.flatnonzero(rows[:, 0] == k)
            out[at] = self.splits[k].windows(rows[at, 1], self.seq_len)
        return out

    def sample_ids(self, rows: np.ndarray) -> list[str]:
        """For --log-samples: dataset/window."""
        return [f"{self.names[k]}/{w}" for k, w in rows.tolist()]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        import torch  # as TokenBatches.next_batch: the launcher checks a mixture's weights here without torch

        self.last_windows = self.take(self.position)
        rows = self.read(self.last_windows, np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64))
        rows_t = torch.from_numpy(rows)
        return rows_t[:, :-1], rows_t[:, 1:]

    def accounting(self, pos: MixturePosition | None = None) -> dict[str, dict[str, float | int]]:
        """Each dataset's tokens and (fractional) epochs so far: for the metrics rows and the summary."""
        pos = pos or self.position
        return {
            name: {
                "tokens": pos.consumed[name] * self.seq_len,
                "epochs": round(pos.consumed[name] / windows, 4) if windows else 0.0,
            }
            for name, windows in zip(self.names, self.windows_of, strict=True)
        }


def resolve_mixture(text: str, checkpoint: dict[str, Any] | None, policy: str) -> list[MixtureEntry]:
    """--mixture's datasets (DIR=WEIGHT: a snapshot's directory, or a dataset's for its current snapshot), each
    resolved as --data-dir is (trainer/snapshot.py): on a resume, the snapshot its checkpoint trained on. All must
    share one tokenizer (their token ids would mean other strings)."""
    from trainer.data import load_meta
    from trainer.snapshot import given_snapshot, snapshot_record, training_snapshot

    try:
        given = parse_weights(text)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    recorded = (checkpoint or {}).get("data_snapshots") or {}
    entries: list[MixtureEntry] = []
    tokenizers: dict[str, str] = {}
    for directory, weight in given:
        snapshot = given_snapshot(Path(directory))
        name = snapshot_record(snapshot, {})["dataset"]
        if any(e.name == name for e in entries):
            raise DataError(f"--mixture: dataset {name!r} is named twice")
        if checkpoint is not None:
            snapshot = training_snapshot(snapshot, {"data_snapshot": recorded.get(name)}, policy)
        entries.append(MixtureEntry(name, snapshot, weight))
        tokenizers[name] = load_meta(snapshot).get("tokenizer_sha256", "")
    one_tokenizer(tokenizers, "--mixture", "stage every dataset of a mixture with the same tokenizer (tokenizer_path)")
    return entries


def mixture_plan(batches: MixtureBatches, sequences: int) -> str:
    """Each dataset's share, size and the epochs a run of `sequences` sequences makes of it: the plan's second line."""
    parts = []
    for name, split, windows, share in zip(
        batches.names, batches.splits, batches.windows_of, shares(batches.weights), strict=True
    ):
        epochs = share * sequences / windows if windows else 0.0
        parts.append(f"{name} {share:.1%} of {len(split):,} tokens ({epochs:.2g} epochs)")
    total = sum(batches.weights)
    scaled = (
        f" (the weights sum to {total:g}, not 1: each share is its weight over the sum)"
        if abs(total - 1) > 1e-9
        else ""
    )
    return "mixture: " + "; ".join(parts) + scaled

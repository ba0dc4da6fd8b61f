"""Tokenization at scale: a bounded tokenizer sample, groups encoded apart (the pipeline's fan-out), and a group
that carries on after the last file it finished when it is killed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from components.stage_data.core import mirror_and_plan, stage_data
from components.stage_data.formats import FileFormat
from components.stage_data.settings import StageSettings
from components.stage_data.tokenization import EOS, Entry, Plan, building_dir, sample_texts
from tests.helpers import encode_until_killed, write_corpus
from trainer.layout import META, TOKENIZER, DatasetPaths


def split_stream(snapshot: Path, split: str) -> np.ndarray:
    meta = json.loads((snapshot / META).read_text())
    return np.concatenate([np.fromfile(snapshot / s["file"], dtype=meta["dtype"]) for s in meta["shards"][split]])


def documents(snapshot: Path, split: str) -> list[str]:
    tokenizer = Tokenizer.from_file(str(snapshot / TOKENIZER))
    return tokenizer.decode(split_stream(snapshot, split).tolist(), skip_special_tokens=False).split(EOS)[:-1]


def test_groups_encode_apart_into_the_same_token_stream(corpus: Path, tmp_path: Path) -> None:
    (corpus_with_empty := tmp_path / "src").mkdir()
    for path in sorted(corpus.rglob("*.txt")):
        (corpus_with_empty / path.relative_to(corpus)).parent.mkdir(exist_ok=True)
        (corpus_with_empty / path.relative_to(corpus)).write_bytes(path.read_bytes())
    (corpus_with_empty / "part-a" / "doc 04b.txt").write_text("")  # an empty document among the others
    one = stage_data(str(corpus_with_empty), str(tmp_path / "one"), "d", vocab_size=300, shard_tokens=1024)
    three = stage_data(str(corpus_with_empty), str(tmp_path / "three"), "d", vocab_size=300, shard_tokens=1024,
                       tokenize_groups=3)  # fmt: skip
    assert one.snapshot != three.snapshot, "the shard layout differs, so the snapshot does"
    a, b = Path(one.tokenized_dir), Path(three.tokenized_dir)
    assert (a / TOKENIZER).read_text() == (b / TOKENIZER).read_text()
    for split in ("train", "val"):
        assert np.array_equal(split_stream(a, split), split_stream(b, split))
    raw = DatasetPaths.of(tmp_path / "three", "d").raw
    assert "" in documents(b, "train") + documents(b, "val")
    assert sorted(documents(b, "train") + documents(b, "val")) == sorted(p.read_text() for p in raw.rglob("*.txt"))
    meta = json.loads((b / META).read_text())
    groups_in_order = [int(s["file"].split("_g")[1][:3]) for s in meta["shards"]["train"]]
    assert groups_in_order == sorted(groups_in_order) and len(set(groups_in_order)) == 3
    assert sorted(p.name for p in b.iterdir() if p.name.startswith(".")) == [], "no bookkeeping left in a snapshot"


def test_the_tokenizer_sample_is_bounded_and_does_not_depend_on_listing_order(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c", files=30, sentences=400)
    files = {p.relative_to(tmp_path / "c").as_posix(): p for p in (tmp_path / "c").rglob("*.txt")}
    entries = [Entry(key, FileFormat("text"), "train") for key in files]
    settings = StageSettings("unused", "unused", "unused")
    budget = 100_000
    sample = list(sample_texts(tmp_path / "c", entries, settings, budget))
    reversed_listing = list(sample_texts(tmp_path / "c", entries[::-1], settings, budget))
    assert sample == reversed_listing
    size = sum(len(b.encode()) for b in sample)
    assert budget <= size < budget + 64 * 2**10 and size < sum(p.stat().st_size for p in files.values()) / 4


def test_a_killed_group_carries_on_after_its_last_finished_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = write_corpus(tmp_path / "src", files=400, sentences=300)
    root = tmp_path / "fsx"
    planned = mirror_and_plan(StageSettings(str(source), str(root), "d", vocab_size=300, shard_tokens=4096))
    building = building_dir(DatasetPaths.of(root, "d"), planned.snapshot)
    journal = building / ".journal-000.jsonl"
    encode_until_killed(root, "d", planned.snapshot, journal, 50)
    files = len(Plan.read(building).groups[0])
    finished = json.loads(journal.read_text().splitlines()[-1])["next"][0]
    assert 50 <= finished < files

    resumed = stage_data(str(source), str(root), "d", vocab_size=300, shard_tokens=4096)
    assert f"{files} files ({finished} finished before)" in caplog.text
    record = json.loads((building.parent / resumed.snapshot / META).read_text())
    clean = stage_data(str(source), str(tmp_path / "clean"), "d", vocab_size=300, shard_tokens=4096)
    assert resumed.snapshot == clean.snapshot == planned.snapshot
    for split in ("train", "val"):
        assert np.array_equal(split_stream(Path(resumed.tokenized_dir), split),
                              split_stream(Path(clean.tokenized_dir), split)), split  # fmt: skip
    assert record["shards"] == json.loads((Path(clean.tokenized_dir) / META).read_text())["shards"]


@pytest.mark.parametrize("groups", [0, 65])
def test_a_group_count_out_of_range_is_one_line(groups: int, corpus: Path, tmp_path: Path) -> None:
    from common.errors import InputError

    with pytest.raises(InputError, match=f"tokenize groups {groups} is out of range"):
        stage_data(str(corpus), str(tmp_path), "d", tokenize_groups=groups)
    assert not any(tmp_path.iterdir())

"""Tokenization at scale: a bounded tokenizer sample, groups encoded apart (the pipeline's fan-out), and a group
that carries on after the last file it finished when it is killed."""

from __future__ import annotations

import gzip
import json
import logging
import re
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from components.stage_data.core import mirror_and_plan, stage_data
from components.stage_data.formats import FileFormat
from components.stage_data.settings import StageSettings
from components.stage_data.tokenization.plan import sample_texts
from components.stage_data.tokenization.snapshot import Entry, Plan, building_dir
from components.stage_data.tokenizer import EOS
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
    three = stage_data(
        str(corpus_with_empty), str(tmp_path / "three"), "d", vocab_size=300, shard_tokens=1024, tokenize_groups=3
    )
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
        assert np.array_equal(
            split_stream(Path(resumed.tokenized_dir), split), split_stream(Path(clean.tokenized_dir), split)
        ), split
    assert record["shards"] == json.loads((Path(clean.tokenized_dir) / META).read_text())["shards"]


@pytest.mark.parametrize("groups", [0, 65])
def test_a_group_count_out_of_range_is_one_line(groups: int, corpus: Path, tmp_path: Path) -> None:
    from common.errors import InputError

    with pytest.raises(InputError, match=f"tokenize groups {groups} is out of range"):
        stage_data(str(corpus), str(tmp_path), "d", tokenize_groups=groups)
    assert not any(tmp_path.iterdir())


# -- what staging says while it works, and when it is done --------------------------------------------------------


def test_long_staging_work_says_how_far_it_got_every_15_seconds(caplog: pytest.LogCaptureFixture) -> None:
    """Tokenizing 282 MB printed nothing for 2-3 minutes. A progress line comes every PROGRESS_EVERY_S (at most half
    of the 30 s a person waits), decided on an injected clock; from a thread of its own, so a long batch or the
    tokenizer trainer's native merge phase does not hold it back."""
    from components.stage_data.progress import PROGRESS_EVERY_S, Progress

    assert PROGRESS_EVERY_S <= 15
    now = [100.0]
    progress = Progress(lambda elapsed: f"{elapsed:.1f} s in", every_s=15, clock=lambda: now[0])
    said = []
    for t in (100.0, 114.9, 115.0, 120.0, 129.9, 130.0, 131.0, 160.0):
        now[0] = t
        said.append(progress.tick())
    assert said == [None, None, "15.0 s in", None, None, "30.0 s in", None, "60.0 s in"]
    assert [r.getMessage() for r in caplog.records if r.name == "components.stage_data.progress"] == [
        "15.0 s in",
        "30.0 s in",
        "60.0 s in",
    ]
    called = threading.Event()
    with Progress(lambda elapsed: str(called.set()), every_s=0, poll_s=0.01):
        assert called.wait(60), "the thread ticks while the work inside runs"


def test_a_groups_progress_line_says_files_bytes_rate_and_time_left_of_what_is_encoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line's figures: the bytes read of the group's files (a resumed group counts from the file it carries on
    at) scaled by the share of the text read that is written, since reading runs up to two batches ahead of the
    encoder (a run-local of 80 MB said "about 2 s left" with nothing written yet). Wired into a group's encode: when
    it is done, the line says every file, every byte and every token."""
    import components.stage_data.tokenization.encode as encode
    from components.stage_data.progress import GroupProgress, SampleProgress

    class Reading:
        bytes_read = 1_000_000

    class Written:
        files_done, text_written = 1, 0

        def tokens_written(self) -> int:
            return 1234567

    written = Written()
    progress = GroupProgress("group 1 of 'web' (2 groups)", [4_000_000, 4_000_000, 2_000_000], 1, written)
    assert progress.line(5.0).startswith("encoding group 1 of 'web' (2 groups): 1 of 2 files done, 0.0 of 6.0 MB")
    progress.reading(2, Reading())
    progress.text_read, written.text_written = 1000, 500  # half of what was read is written
    assert progress.line(10.0) == (
        "encoding group 1 of 'web' (2 groups): 1 of 2 files done, 2.5 of 6.0 MB, 0.2 MB/s, about 14 s left; "
        "1,234,567 tokens written"
    )
    sample = SampleProgress(1024)
    texts = sample.counted(iter(["ab", "cdé"]))
    next(texts)
    said = "training the tokenizer: 0.0 MB of text read into its sample (up to 1,024 MB), 3 s so far"
    assert sample.line(3.0) == said
    list(texts)
    assert sample.bytes == 6 and sample.line(4.0).startswith("training the tokenizer: its sample of 0.0 MB read, ")

    made = []  # each Progress's line maker, in place of the thread that would call it

    class Recorded:
        def __init__(self, describe, *args: object, **kwargs: object) -> None:
            made.append(describe)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(encode, "Progress", Recorded)
    source = write_corpus(tmp_path / "src", files=2, sentences=50)
    rows = "".join(json.dumps({"text": f"record {i} " * 30}) + "\n" for i in range(200))
    (source / "records.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    root = tmp_path / "fsx"
    planned = mirror_and_plan(StageSettings(str(source), str(root), "d", vocab_size=300))
    result = encode.encode_group(DatasetPaths.of(root, "d"), planned.snapshot, 0)
    total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file()) / 1e6
    line = made[-1](1.0)
    assert line.startswith(f"encoding group 0 of 'd' (1 groups): 3 of 3 files done, {total:,.1f} of {total:,.1f} MB, ")
    assert line.endswith(f"; {result.tokens['train'] + result.tokens['val']:,} tokens written"), line


def test_run_locals_quiet_console_shows_the_progress_lines(tmp_path: Path) -> None:
    """run-local's default output keeps staging's lines (pipelines/local_run.py keep_line): a progress line as a
    step's logging writes it (components/kfp_support.py setup_logging, in a process of its own) is shown."""
    import subprocess
    import sys

    from pipelines.local_run import keep_line, shown

    code = (
        "from components.kfp_support import setup_logging\n"
        "from components.stage_data.progress import Progress\n"
        "setup_logging()\n"
        "Progress(lambda s: 'encoding group 0 of \\'d\\' (2 groups): 1 of 6 files done', every_s=0).tick()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    (line,) = [line for line in (result.stdout + result.stderr).splitlines() if "encoding group" in line]
    assert keep_line(line)
    assert re.fullmatch(r"    \d\d:\d\d:\d\d encoding group 0 of 'd' \(2 groups\): 1 of 6 files done", shown(line))


def test_the_finished_line_says_how_the_val_split_was_held_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It said "tokenized 12 files (0 held out for val) ...: 77286581 train + 647717 val tokens" of a corpus of
    records, whose val split holds documents, not files."""
    source = write_corpus(tmp_path / "src", files=2, sentences=50)
    rows = "".join(json.dumps({"text": f"record {i} " * 30}) + "\n" for i in range(200))
    (source / "records.jsonl").write_text(rows)
    caplog.set_level(logging.INFO)
    result = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300, val_fraction=0.2)
    split = result.documents["documents"]
    assert split["val"] > 0 and not [line for line in caplog.messages if "held out for val" in line]
    said = (
        f"tokenized 3 files of 'd' into snapshot {result.snapshot}: {result.train_tokens:,} train + "
        f"{result.val_tokens:,} val tokens (val: 1 plain-text file whole and 20% of the records' documents, "
        f"{split['val']:,} of {split['train'] + split['val']:,} documents), vocabulary 300, in "
    )
    assert [line for line in caplog.messages if line.startswith(said)], caplog.messages

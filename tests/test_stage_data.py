import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from common.errors import InputError
from components.stage_data.core import stage_data
from components.stage_data.mirror import ProgressLog
from components.stage_data.tokenization.plan import STALE_BUILD_S, val_keys
from components.stage_data.tokenizer import EOS
from tests.helpers import snapshot_dir
from trainer.layout import META, TOKENIZER, DatasetPaths


def test_stages_mirror_manifest_and_shards(staged_root: Path, corpus: Path) -> None:
    paths = DatasetPaths.of(staged_root, "synthetic")
    manifest = json.loads(paths.manifest.read_text())
    sources = sorted(p for p in corpus.rglob("*") if p.is_file())
    assert [e["key"] for e in manifest["files"]] == sorted(p.relative_to(corpus).as_posix() for p in sources)
    for entry in manifest["files"]:
        mirrored = paths.raw / entry["key"]
        assert mirrored.read_bytes() == (corpus / entry["key"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(mirrored.read_bytes()).hexdigest()
        assert entry["size"] == mirrored.stat().st_size

    snapshot = snapshot_dir(staged_root, "synthetic")
    meta = json.loads((snapshot / META).read_text())
    tokenizer = Tokenizer.from_file(str(snapshot / TOKENIZER))
    assert meta["vocab_size"] == tokenizer.get_vocab_size() <= 512
    for split in ("train", "val"):
        tokens = sum(np.fromfile(snapshot / s["file"], dtype=meta["dtype"]).size for s in meta["shards"][split])
        assert tokens == meta["tokens"][split] > 0
    # Whole files are held out for val; the token stream decodes back to the corpus text (byte-level BPE).
    keys = [e["key"] for e in manifest["files"]]
    held_out = val_keys(keys, 0.1)
    assert meta["val_files"] == len(held_out) >= 1
    train_keys, val_keys_in_order = [k for k in keys if k not in held_out], [k for k in keys if k in held_out]
    for split, split_keys in (("train", train_keys), ("val", val_keys_in_order)):
        stream = np.concatenate([np.fromfile(snapshot / s["file"], dtype=meta["dtype"]) for s in meta["shards"][split]])
        documents = tokenizer.decode(stream.tolist(), skip_special_tokens=False).split(EOS)
        assert documents == [(paths.raw / k).read_text() for k in split_keys] + [""]
    assert list(paths.root.glob(".*")) == [paths.staging_lock], "no temporary files left behind"


def test_rerun_is_incremental_and_drops_deleted_files(corpus: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for p in list(corpus.rglob("*.txt"))[:4]:
        (source / p.name).write_bytes(p.read_bytes())
    first = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300)
    assert (first.files_copied, first.files_skipped) == (4, 0)

    victim = sorted(source.iterdir())[0]
    victim.unlink()
    changed = sorted(source.iterdir())[0]
    changed.write_text(changed.read_text() + "the new node trains the model.\n")
    second = stage_data(f"file://{source}", str(tmp_path / "fsx"), "d", vocab_size=300)
    assert (second.files, second.files_copied, second.files_skipped, second.files_deleted) == (3, 1, 2, 1)
    assert second.tokenized
    raw = DatasetPaths.of(tmp_path / "fsx", "d").raw
    assert not (raw / victim.name).exists()
    assert (raw / changed.name).read_text().endswith("the new node trains the model.\n")


def test_loads_a_given_tokenizer(staged_root: Path, corpus: Path, tmp_path: Path) -> None:
    given = snapshot_dir(staged_root, "synthetic") / TOKENIZER
    result = stage_data(str(corpus), str(tmp_path), "reuse", tokenizer_path=str(given))
    assert (snapshot_dir(tmp_path, "reuse") / TOKENIZER).read_text() == given.read_text()
    assert result.vocab_size == Tokenizer.from_file(str(given)).get_vocab_size()


def test_include_filters(corpus: Path, tmp_path: Path) -> None:
    result = stage_data(str(corpus), str(tmp_path), "only-a", vocab_size=300, include=["part-a/*"])
    keys = [e["key"] for e in json.loads(DatasetPaths.of(tmp_path, "only-a").manifest.read_text())["files"]]
    assert result.files == len(keys) == 6 and all(k.startswith("part-a/") for k in keys)


def test_a_symlinked_subdirectory_is_staged_like_a_symlinked_file(corpus: Path, tmp_path: Path) -> None:
    """A source of links (to the corpus's directories and one of its files, and a link back up the tree) stages what
    they reach, each file once; Path.rglob followed the file and not the directories: "no files to stage"."""
    source = tmp_path / "links"
    source.mkdir()
    (source / "a").symlink_to(corpus / "part-a", target_is_directory=True)
    first = sorted((corpus / "part-b").iterdir())[0]
    (source / "one.txt").symlink_to(first)
    (source / "a-again").symlink_to(source, target_is_directory=True)  # a loop: read once
    result = stage_data(str(source), str(tmp_path / "fsx"), "linked", vocab_size=300)
    keys = sorted(
        e["key"] for e in json.loads(DatasetPaths.of(tmp_path / "fsx", "linked").manifest.read_text())["files"]
    )
    assert keys == sorted([f"a/{p.name}" for p in (corpus / "part-a").iterdir()] + ["one.txt"])
    assert result.files == len(keys)


@pytest.mark.parametrize(
    "files, include, message",
    [
        (None, ["*"], "does not exist"),
        ({"a.txt": "text"}, ["*.md"], "no files to stage"),
        ({"a.txt": "", "b.txt": ""}, ["*"], "all 2 files are empty"),
    ],
    ids=["missing", "nothing-matches", "all-empty"],
)
def test_bad_source_fails_and_writes_nothing(tmp_path: Path, files, include, message: str) -> None:
    source = tmp_path / "src"
    if files is not None:
        source.mkdir()
        for name, text in files.items():
            (source / name).write_text(text)
    with pytest.raises(InputError, match=message):
        stage_data(str(source), str(tmp_path / "fsx"), "d", include=include)
    assert not (tmp_path / "fsx").exists()


def test_unwritable_storage_root(corpus: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(InputError, match="not writable"):
        stage_data(str(corpus), str(blocker / "fsx"), "d")


@pytest.mark.parametrize("dataset", ["../escape", "", "a/b", ".hidden"])
def test_bad_dataset_name(corpus: Path, tmp_path: Path, dataset: str) -> None:
    with pytest.raises(InputError, match="not a valid name"):
        stage_data(str(corpus), str(tmp_path), dataset)
    assert not any(tmp_path.iterdir())


def test_an_unchanged_or_only_touched_source_is_neither_copied_nor_retokenized(corpus: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(corpus, source)
    stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300)
    meta = (snapshot_dir(tmp_path / "fsx", "d") / META).read_text()
    touched = next(source.rglob("*.txt"))
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    again = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300)
    assert (again.files_copied, again.files_skipped, again.tokenized) == (0, 12, False)
    assert (snapshot_dir(tmp_path / "fsx", "d") / META).read_text() == meta
    entry = next(
        e
        for e in json.loads(DatasetPaths.of(tmp_path / "fsx", "d").manifest.read_text())["files"]
        if e["key"] == touched.relative_to(source).as_posix()
    )
    assert entry["mtime_ns"] == touched.stat().st_mtime_ns, "the new mtime is recorded: no hashing next time"
    killed_mid_tokenizing = DatasetPaths.of(tmp_path / "fsx", "d").snapshots / ".building.k1ll3d"
    killed_mid_tokenizing.mkdir()
    (killed_mid_tokenizing / "plan.json").write_text("{}")
    a_day_ago = time.time() - STALE_BUILD_S - 60  # a staging killed a day ago with other inputs, never rerun
    os.utime(killed_mid_tokenizing / "plan.json", (a_day_ago, a_day_ago))
    retokenized = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=400)
    assert not killed_mid_tokenizing.exists()
    assert retokenized.files_copied == 0 and retokenized.tokenized, "a new vocabulary size re-tokenizes"


def test_a_single_file_cannot_hold_out_a_val_file(tmp_path: Path) -> None:
    (tmp_path / "one.txt").write_text("the node saves the rank.\n" * 100)
    with pytest.raises(InputError, match="holds out whole files"):
        stage_data(str(tmp_path / "one.txt"), str(tmp_path / "fsx"), "d", vocab_size=300)
    assert not (tmp_path / "fsx").exists()


def test_a_second_staging_run_of_a_dataset_waits_for_the_first(
    corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = DatasetPaths.of(tmp_path / "fsx", "d")
    paths.root.mkdir(parents=True)
    with open(paths.staging_lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a run staging this dataset right now does
        second = threading.Thread(
            target=stage_data, args=(str(corpus), str(tmp_path / "fsx"), "d"), kwargs={"vocab_size": 300}
        )
        second.start()
        second.join(timeout=2)
        assert second.is_alive() and not paths.manifest.exists(), "it waits while the lock is held"
    second.join(timeout=60)
    assert not second.is_alive() and paths.current_snapshot() is not None
    assert "holds its lock; waiting" in caplog.text


def test_progress_lines_say_files_bytes_rate_and_eta(caplog: pytest.LogCaptureFixture) -> None:
    progress = ProgressLog(files=4, total_bytes=4_000_000, every_s=0.0)
    progress.add_bytes(1_000_000)
    progress.file_done()
    assert re.search(r"staged 0/4 files, 1\.0/4\.0 MB, [\d.]+ MB/s, ETA \d+s", caplog.text)
    assert "staged 1/4 files" in caplog.text


def mirrored_files(paths: DatasetPaths) -> dict[str, bytes]:
    return {p.relative_to(paths.raw).as_posix(): p.read_bytes() for p in paths.raw.rglob("*") if p.is_file()}


def test_a_narrower_include_keeps_the_mirror_and_widening_it_again_copies_nothing(corpus: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(corpus, source)
    paths = DatasetPaths.of(tmp_path / "fsx", "d")
    full = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300)
    before = mirrored_files(paths)

    narrow = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300, include=["part-a/*"])
    assert (narrow.files, narrow.files_copied, narrow.files_deleted, narrow.files_retained) == (6, 0, 0, 6)
    assert narrow.tokenized and narrow.content_sha256 != full.content_sha256
    assert mirrored_files(paths) == before, "nothing outside the filter is removed"
    manifest = json.loads(paths.manifest.read_text())
    assert [e["key"] for e in manifest["files"]] == sorted(k for k in before if k.startswith("part-a/"))
    assert [e["key"] for e in manifest["retained"]] == sorted(k for k in before if k.startswith("part-b/"))

    wide = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300)
    assert (wide.files, wide.files_copied, wide.files_skipped, wide.files_retained) == (12, 0, 12, 0)
    assert wide.content_sha256 == full.content_sha256
    assert wide.snapshot == full.snapshot and not wide.tokenized, "the same content is the first snapshot again"
    assert (wide.train_tokens, wide.val_tokens) == (full.train_tokens, full.val_tokens)
    assert json.loads(paths.manifest.read_text())["retained"] == []


def test_outside_the_include_a_changed_file_is_not_trusted_and_a_deleted_one_goes(corpus: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(corpus, source)
    paths = DatasetPaths.of(tmp_path / "fsx", "d")
    stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300)
    stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300, include=["part-a/*"])

    def rewrite_same_size(key: str) -> bytes:
        """New bytes of the same size and a later mtime: only the content shows the change."""
        path = source / key
        old, stat = path.read_bytes(), path.stat()
        new = old.replace(b"the", b"THE", 1)
        assert new != old and len(new) == len(old)
        path.write_bytes(new)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        return new

    changed = rewrite_same_size("part-b/doc 00.txt")
    (source / "part-b/doc 02.txt").unlink()
    partial = paths.raw / "part-b/.doc 06.txt.0123456789abcdef.part"
    partial.write_bytes(b"left by a killed run")
    kept = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300, keep_deleted=True)
    assert (kept.files, kept.files_copied, kept.files_deleted) == (11, 1, 0), "the changed file is copied again"
    assert (paths.raw / "part-b/doc 00.txt").read_bytes() == changed
    assert (paths.raw / "part-b/doc 02.txt").exists(), "kept: --keep-deleted"
    assert not partial.exists(), "a partial file goes, --keep-deleted or not"

    stale = rewrite_same_size("part-b/doc 04.txt")
    narrow = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300, include=["part-a/*"])
    assert (narrow.files, narrow.files_copied, narrow.files_deleted, narrow.files_retained) == (6, 0, 2, 4)
    assert "part-b/doc 02.txt" not in mirrored_files(paths), "gone from the source"
    assert "part-b/doc 04.txt" not in mirrored_files(paths), "changed in the source: the mirror cannot vouch for it"

    wide = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300)
    assert (wide.files, wide.files_copied, wide.files_skipped, wide.files_deleted) == (11, 1, 10, 0)
    assert (paths.raw / "part-b/doc 04.txt").read_bytes() == stale
    expected = {p.relative_to(source).as_posix(): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    assert mirrored_files(paths) == expected


def test_staging_and_the_launcher_start_without_torch() -> None:
    """The staging step, each task of its fan-out and the launcher read the trainer's metadata, errors and mixture
    weights, never its tensors: each starts without importing torch (about 2 CPU-s of a process's start)."""
    modules = ["stage_data.component", "stage_data.core", "stage_data.mixture", "launch_training.core"]
    probe = f"import sys, {', '.join(f'components.{m}' for m in modules)}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr

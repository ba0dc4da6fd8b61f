"""The corpora teams bring: Parquet, JSON Lines plain and compressed, and plain text, made here with pyarrow, gzip and
zstandard; what the shards hold must decode back to exactly each document's text, read independently of staging
(pyarrow and json, in this file), each followed by EOS and preceded by BOS where the tokenizer has one, in order."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from common.errors import InputError
from components.evaluate_checkpoint.export import export_model
from components.stage_data.core import mirror_and_plan, stage_data
from components.stage_data.settings import StageSettings
from components.stage_data.tokenization.snapshot import building_dir, document_position
from tests.helpers import ADJECTIVES, NOUNS, VERBS, encode_until_killed, run_cli, write_corpus
from tests.tokenizer_kinds import KINDS, make_tokenizer, save_pretrained
from trainer.layout import META, TOKENIZER, DatasetPaths
from trainer.model import build_model, model_config


def sentence(rng: random.Random) -> str:
    return f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(VERBS)} the {rng.choice(NOUNS)}."


def document(rng: random.Random) -> str:
    """Text as documents hold it: several lines, now and then a paragraph break, a non-ASCII word, a JSON-looking
    brace (to be kept as text, never parsed)."""
    lines = [" ".join(sentence(rng) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.3:
        lines.insert(1, "")
    if rng.random() < 0.2:
        lines.append('naïve café — {"not": "json"} 東京')
    return "\n".join(lines)


def records(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Records with text, and now and then one without: null, empty, missing, not a string."""
    made = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.04:
            made.append({"id": i, "text": None})
        elif roll < 0.07:
            made.append({"id": i, "text": ""})
        elif roll < 0.09:
            made.append({"id": i, "body": document(rng)})
        elif roll < 0.10:
            made.append({"id": i, "text": 42})
        else:
            made.append({"id": i, "text": document(rng)})
    return made


def write_jsonl(path: Path, rows: list[dict[str, Any]], compression: str = "", frames: int = 1) -> Path:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":  # several frames, as a file appended to by the zstd tool
        cut = [len(data) * k // frames for k in range(frames + 1)]
        data = b"".join(zstandard.ZstdCompressor().compress(data[a:b]) for a, b in zip(cut, cut[1:], strict=False))
    path.write_bytes(data)
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], row_group_size: int) -> Path:
    """A `text` string column (nulls and empty strings among it) beside an `id`, in several row groups."""
    texts = [r["text"] if isinstance(r.get("text"), str) else None for r in rows]
    table = pa.table({"id": pa.array([r["id"] for r in rows], pa.int64()), "text": pa.array(texts, pa.string())})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def corpus_of_every_format(directory: Path, seed: int = 0) -> Path:
    rng = random.Random(seed)
    (directory / "web").mkdir(parents=True)
    (directory / "books").mkdir()
    write_parquet(directory / "web" / "part-000.parquet", records(rng, 120), row_group_size=25)
    write_jsonl(directory / "web" / "part-001.jsonl", records(rng, 60))
    write_jsonl(directory / "web" / "part-002.jsonl.gz", records(rng, 60), "gzip")
    write_jsonl(directory / "web" / "part-003.jsonl.zst", records(rng, 80), "zstd", frames=3)
    for i in range(3):
        (directory / "books" / f"book-{i}.txt").write_text(document(rng) + "\n")
    return directory


# -- the independent reader: what the test itself takes each file to hold ------------------------------------------


def expected_documents(directory: Path, text_field: str = "text") -> list[tuple[str, int, str]]:
    """(key, record, text) of every document, in the order staging plans files (sorted keys), read with pyarrow and
    json directly."""
    found = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        key = path.relative_to(directory).as_posix()
        if key.endswith(".parquet"):
            values = pq.read_table(path, columns=[text_field]).column(0).to_pylist()
            found += [(key, i, v) for i, v in enumerate(values) if isinstance(v, str) and v]
        elif ".jsonl" in key:
            raw = path.read_bytes()
            raw = gzip.decompress(raw) if key.endswith(".gz") else raw
            raw = (
                zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True).read()
                if key.endswith(".zst")
                else raw
            )
            for number, line in enumerate(raw.decode().splitlines()):
                value = json.loads(line)
                for name in text_field.split("."):
                    value = value.get(name) if isinstance(value, dict) else None
                if isinstance(value, str) and value:
                    found.append((key, number, value))
        else:
            found.append((key, 0, path.read_text()))
    return found


def split_stream(snapshot: Path, split: str) -> list[int]:
    meta = json.loads((snapshot / META).read_text())
    return np.concatenate(
        [np.fromfile(snapshot / s["file"], dtype=meta["dtype"]) for s in meta["shards"][split]]
    ).tolist()


def decoded_documents(snapshot: Path, split: str) -> list[str]:
    """The split's token stream cut after each EOS, each document checked to begin with BOS where the tokenizer has
    one, and decoded alone."""
    meta = json.loads((snapshot / META).read_text())
    tokenizer = Tokenizer.from_file(str(snapshot / TOKENIZER))
    stream, eos, bos = split_stream(snapshot, split), meta["eos_id"], meta.get("bos_id")
    assert stream[-1] == eos, "every document ends with EOS"
    documents, start = [], 0
    for end in (i for i, t in enumerate(stream) if t == eos):
        ids = stream[start:end]
        if bos is not None:
            assert ids[0] == bos, "every document begins with BOS"
            ids = ids[1:]
        assert eos not in ids and (bos is None or bos not in ids)
        documents.append(tokenizer.decode(ids, skip_special_tokens=False))
        start = end + 1
    return documents


def test_every_format_decodes_back_to_its_documents_in_order(tmp_path: Path) -> None:
    source = corpus_of_every_format(tmp_path / "corpus")
    result = stage_data(
        str(source), str(tmp_path / "fsx"), "mixed", vocab_size=400, val_fraction=0.2, tokenize_groups=2
    )
    snapshot = Path(result.tokenized_dir)
    meta = json.loads((snapshot / META).read_text())
    val_books = set(json.loads(DatasetPaths.of(tmp_path / "fsx", "mixed").val_set.read_text())["keys"])
    expected = expected_documents(source)

    def split_of(key: str, record: int) -> str:
        if key.endswith(".txt"):
            return "val" if key in val_books else "train"
        return "val" if document_position(key, record) < 0.2 else "train"

    for split in ("train", "val"):
        wanted = [text for key, record, text in expected if split_of(key, record) == split]
        assert decoded_documents(snapshot, split) == wanted, split
    assert len(val_books) == 1, "plain text: whole files, at least one"
    assert meta["bos_id"] is None and meta["eos"] == "<|endoftext|>"

    report = result.documents
    assert set(report["formats"]) == {"parquet", "jsonl", "jsonl.gz", "jsonl.zst", "text"}
    assert report["formats"]["parquet"]["files"] == 1 and report["formats"]["text"]["files"] == 3
    assert sum(c["documents"] for c in report["formats"].values()) == len(expected) == meta["documents"]
    assert sum(c["tokens"] for c in report["formats"].values()) == sum(meta["tokens"].values())
    without_text = json.loads(json.dumps(report["skipped"]))
    assert set(without_text) <= {"null", "empty", "missing", "not a string"} and without_text["null"] > 0
    rows = {"parquet": 120, "jsonl": 60, "jsonl.gz": 60, "jsonl.zst": 80}
    for name, count in rows.items():  # every record is a document or a skipped one, and nothing else
        assert report["formats"][name]["documents"] <= count
    assert sum(without_text.values()) + sum(report["formats"][n]["documents"] for n in rows) == sum(rows.values())
    first_parquet = next(
        text for key, record, text in expected if key.endswith(".parquet") and split_of(key, record) == "train"
    )
    assert report["first_documents"]["parquet"] == first_parquet + "<|endoftext|>"
    assert 0 < report["tokens_per_document"]["median"] <= report["tokens_per_document"]["p99"]
    assert meta["model_vocab_size"] % 64 == 0 and meta["model_vocab_size"] >= meta["vocab_size"]


def test_a_nested_field_and_the_report_of_records_without_text(tmp_path: Path) -> None:
    rng = random.Random(3)
    (source := tmp_path / "corpus").mkdir()
    rows = [{"meta": {"lang": "en"}, "content": {"body": document(rng)}} for _ in range(40)]
    rows[5] = {"content": {"title": "no body"}}
    rows[9] = {"content": None}
    write_jsonl(source / "a.jsonl.zst", rows, "zstd")
    result = stage_data(
        str(source), str(tmp_path / "fsx"), "nested", vocab_size=300, val_fraction=0.2, text_field="content.body"
    )
    snapshot = Path(result.tokenized_dir)
    texts = [text for _, _, text in expected_documents(source, "content.body")]
    assert sorted(decoded_documents(snapshot, "train") + decoded_documents(snapshot, "val")) == sorted(texts)
    assert len(texts) == 38 and result.documents["skipped"] == {"missing": 2}
    assert result.documents["examples"] == ["a.jsonl.zst:6: missing", "a.jsonl.zst:10: missing"]


def test_the_val_split_holds_out_documents_of_a_single_large_file(tmp_path: Path) -> None:
    rng = random.Random(5)
    (source := tmp_path / "corpus").mkdir()
    write_parquet(source / "only.parquet", [{"id": i, "text": document(rng)} for i in range(400)], 100)
    result = stage_data(str(source), str(tmp_path / "fsx"), "one-file", vocab_size=300, val_fraction=0.05)
    split = result.documents["documents"]
    assert split["train"] + split["val"] == 400 and 8 <= split["val"] <= 35, split
    again = stage_data(str(source), str(tmp_path / "fsx"), "one-file", vocab_size=300, val_fraction=0.05)
    assert again.snapshot == result.snapshot and not again.tokenized, "unchanged inputs: the same snapshot"


@pytest.mark.parametrize("kind", KINDS)
def test_each_tokenizer_family_stages_with_its_own_bos_and_eos(kind: str, tmp_path: Path) -> None:
    source = corpus_of_every_format(tmp_path / "corpus")
    texts = [text for _, _, text in expected_documents(source)]
    given = save_pretrained(kind, make_tokenizer(kind, texts), tmp_path / f"tokenizer-{kind}")
    result = stage_data(str(source), str(tmp_path / "fsx"), kind, tokenizer_path=str(given), val_fraction=0.2)
    snapshot = Path(result.tokenized_dir)
    meta = json.loads((snapshot / META).read_text())
    bos, eos = {
        "llama3": ("<|begin_of_text|>", "<|end_of_text|>"),
        "sentencepiece": ("<s>", "</s>"),
        "gpt2": (None, "<|endoftext|>"),
        "eos-only": (None, "</s>"),
    }[kind.removesuffix("-bare")]
    assert (meta["bos"], meta["eos"]) == (bos, eos)
    tokenizer = Tokenizer.from_file(str(snapshot / TOKENIZER))
    assert meta["vocab_size"] == tokenizer.get_vocab_size() and meta["model_vocab_size"] % 64 == 0
    assert sorted(decoded_documents(snapshot, "train") + decoded_documents(snapshot, "val")) == sorted(texts)
    # what Hugging Face users do with the snapshot's tokenizer gives what training saw: [BOS] text
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(snapshot / TOKENIZER), bos_token=bos, eos_token=eos)
    stream = split_stream(snapshot, "train")
    first = decoded_documents(snapshot, "train")[0]
    assert hf(first)["input_ids"] == stream[: stream.index(meta["eos_id"])]
    # and so does the tokenizer an export of a model trained on it carries (the evaluation step's export_model)
    from transformers import AutoConfig, AutoTokenizer

    model = build_model(model_config("tiny", meta["model_vocab_size"], 32, meta["eos_id"], 0.0, meta.get("bos_id")))
    export = export_model(model, snapshot, tmp_path / "export", {"step": 0})
    assert AutoConfig.from_pretrained(export).vocab_size == meta["model_vocab_size"]
    assert AutoTokenizer.from_pretrained(export)(first)["input_ids"] == stream[: stream.index(meta["eos_id"])]


# -- refusals: one line, and nothing left among the dataset's snapshots ---------------------------------------------


def refused(source: Path, root: Path, match: str, **settings: Any) -> None:
    with pytest.raises(InputError, match=match) as caught:
        stage_data(str(source), str(root), "bad", vocab_size=300, **settings)
    assert "\n" not in str(caught.value), "one line"
    snapshots = DatasetPaths.of(root, "bad").snapshots
    assert not snapshots.exists() or not any(snapshots.iterdir()), list(snapshots.iterdir())


def two_good_files(source: Path) -> Path:
    rng = random.Random(1)
    source.mkdir(parents=True)
    write_jsonl(source / "good-1.jsonl", [{"text": document(rng)} for _ in range(30)])
    write_jsonl(source / "good-2.jsonl", [{"text": document(rng)} for _ in range(30)])
    return source


def test_a_parquet_file_without_the_column_or_of_another_type_is_refused(tmp_path: Path) -> None:
    source = two_good_files(tmp_path / "a")
    pq.write_table(pa.table({"id": [1, 2], "content": ["x", "y"]}), source / "web.parquet")
    refused(source, tmp_path / "fsx", r"web.parquet: no column 'text'; its columns are id, content")
    pq.write_table(pa.table({"id": [1, 2], "text": [3, 4]}), source / "web.parquet")
    refused(source, tmp_path / "fsx", r"web.parquet: column 'text' is int64, not a string type")


def test_truncated_corrupt_and_binary_files_are_refused_by_name(tmp_path: Path) -> None:
    source = two_good_files(tmp_path / "a")
    rng = random.Random(2)
    whole = write_parquet(tmp_path / "whole.parquet", [{"id": i, "text": document(rng)} for i in range(50)], 10)
    (source / "cut.parquet").write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    refused(source, tmp_path / "fsx", r"cut.parquet: begins like Parquet but cannot be read")
    (source / "cut.parquet").unlink()

    gz = write_jsonl(tmp_path / "x.jsonl.gz", [{"text": document(rng)} for _ in range(200)], "gzip").read_bytes()
    (source / "cut.jsonl.gz").write_bytes(gz[: len(gz) - 40])
    refused(source, tmp_path / "fsx", r"cut.jsonl.gz: the gzip stream ends early")
    (source / "cut.jsonl.gz").unlink()

    zst = bytearray(
        write_jsonl(tmp_path / "x.jsonl.zst", [{"text": document(rng)} for _ in range(200)], "zstd").read_bytes()
    )
    zst[40:80] = bytes(40)
    (source / "bad.jsonl.zst").write_bytes(bytes(zst))
    refused(source, tmp_path / "fsx", r"bad.jsonl.zst: corrupt zstd data")
    (source / "bad.jsonl.zst").unlink()

    (source / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    refused(source, tmp_path / "fsx", r"photo.png: a PNG image, not text")
    (source / "photo.png").unlink()
    (source / "blob.bin").write_bytes(bytes(range(256)) * 8)
    refused(source, tmp_path / "fsx", r"blob.bin: binary data")


def test_json_lines_of_arrays_and_lines_that_are_not_json(tmp_path: Path) -> None:
    source = two_good_files(tmp_path / "a")
    (source / "arrays.jsonl").write_text('[1, 2]\n["a"]\n')
    refused(source, tmp_path / "fsx", r"arrays.jsonl: its records are not JSON objects \(line 1 is an array\)")
    (source / "arrays.jsonl").unlink()

    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(50)]
    lines[30] = '{"text": "cut short'
    (source / "torn.jsonl").write_text("\n".join(lines) + "\n")
    refused(source, tmp_path / "fsx", r"torn.jsonl:31: not JSON .*allows 0 malformed records \(max_bad_records\)")

    allowed = stage_data(str(source), str(tmp_path / "ok"), "ok", vocab_size=300, max_bad_records=1, val_fraction=0.1)
    assert allowed.documents["bad_records"] == 1 and allowed.documents["examples"] == ["torn.jsonl:31: not JSON"]
    assert allowed.documents["documents"]["train"] + allowed.documents["documents"]["val"] == 60 + 49


def test_records_whose_text_is_in_another_field_are_refused_at_the_plan_naming_the_fields_they_have(
    tmp_path: Path,
) -> None:
    """A source whose records all lack the text field staged to nothing and failed at the finalize step ("the train
    split has only 0 tokens"), after training a tokenizer on nothing; the dry run showed it as skipped records. Each
    is refused at the plan, before the tokenizer, naming the file, its dataset, the field and the fields there are
    (the one with the most text first among the hints). Records that only now and then lack it still stage."""
    from components.stage_data.preview import dry_run

    rng = random.Random(4)
    (web := tmp_path / "web").mkdir()
    write_jsonl(web / "web.jsonl", [{"id": i, "body": document(rng)} for i in range(40)])
    said = (
        r"^source file web.jsonl of dataset 'bad': none of its 40 records has the text field 'text'; they have id, "
        r"body: name the text field with text_field \(--text-field body; a mixture entry's own: --mixture-text-field "
        r"bad=body\)$"
    )
    refused(web, tmp_path / "fsx", said)
    with pytest.raises(InputError, match=said.replace("'bad'", "'web'").replace("bad=", "web=")):
        dry_run(StageSettings(str(web), str(tmp_path / "dry"), "web", vocab_size=300))
    assert not (tmp_path / "dry").exists(), "a dry run writes nothing"

    code = two_good_files(tmp_path / "code")
    rows = [{"repo": "r", "path": f"f{i}.py", "content": f"def f{i}():\n    return {i}\n"} for i in range(30)]
    write_jsonl(code / "code.jsonl.zst", rows, "zstd")
    field = r"of dataset 'bad': none of its (30|40) records has the text field"
    refused(
        code,
        tmp_path / "fsx",
        rf"code.jsonl.zst {field} 'text'; they have repo, path, content: .*--text-field content;",
    )
    refused(code, tmp_path / "fsx", rf"good-1.jsonl {field} 'content'; they have text: ", text_field="content")
    refused(
        web, tmp_path / "fsx", rf"web.jsonl {field} 'body.text'; they have body \(a string\): ", text_field="body.text"
    )

    (some := tmp_path / "some").mkdir()
    write_jsonl(some / "a.jsonl", [{"id": 0}, {"id": 1}] + [{"text": document(rng)} for _ in range(30)])
    staged = stage_data(str(some), str(tmp_path / "ok"), "ok", vocab_size=300, val_fraction=0.2)
    assert staged.documents["skipped"] == {"missing": 2}, "records that now and then lack the field are skipped"
    (nulls := tmp_path / "nulls").mkdir()
    write_jsonl(nulls / "a.jsonl", [{"text": None}] * 20)
    said = r"^dataset 'bad': the train split has only 0 tokens \(skipped records, text field 'text': 20 null\): the "
    refused(nulls, tmp_path / "fsx", said + "corpus is too small$")


def test_a_text_field_for_plain_text_and_tokenizers_without_an_end_token_or_that_cannot_encode_are_refused(
    tmp_path: Path,
) -> None:
    source = tmp_path / "plain"
    for i in range(3):
        (source / f"{i}.txt").parent.mkdir(exist_ok=True)
        (source / f"{i}.txt").write_text(f"plain text number {i}\n" * 50)
    refused(source, tmp_path / "fsx", r"text field 'body': the corpus is plain text", text_field="body")

    (broken := tmp_path / "broken.json").write_text('{"model": ')
    refused(source, tmp_path / "fsx", r"broken.json: tokenizer.json does not load", tokenizer_path=str(broken))

    no_end = Tokenizer(models.BPE())
    no_end.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    no_end.train_from_iterator(["plain text number"] * 20, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    no_end.save(str(bare := tmp_path / "no-end.json"))
    refused(
        source,
        tmp_path / "fsx",
        r"it defines no end-of-document token .*tokenizer_config.json",
        tokenizer_path=str(bare),
    )

    words = Tokenizer(models.WordLevel(vocab={"</s>": 0, "plain": 1, "text": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # a word it lacks raises: its unknown token is not in it
    words.save(str(unknown := tmp_path / "words.json"))
    refused(
        source,
        tmp_path / "fsx",
        r"words.json: cannot encode text \(WordLevel error: Missing \[UNK\] token",
        tokenizer_path=str(unknown),
    )


def test_a_killed_encode_of_a_large_parquet_file_carries_on_after_its_last_row_group(tmp_path: Path) -> None:
    rng = random.Random(7)
    (source := tmp_path / "src").mkdir()
    write_parquet(source / "big.parquet", [{"id": i, "text": document(rng)} for i in range(4000)], 100)
    root = tmp_path / "fsx"
    planned = mirror_and_plan(StageSettings(str(source), str(root), "d", vocab_size=300, shard_tokens=4096))
    journal = building_dir(DatasetPaths.of(root, "d"), planned.snapshot) / ".journal-000.jsonl"
    encode_until_killed(root, "d", planned.snapshot, journal, 8)
    entry, row_group = json.loads(journal.read_text().splitlines()[-1])["next"]
    assert entry == 0 and 8 <= row_group < 40, "killed inside the one file, after whole row groups"

    resumed = stage_data(str(source), str(root), "d", vocab_size=300, shard_tokens=4096)
    clean = stage_data(str(source), str(tmp_path / "clean"), "d", vocab_size=300, shard_tokens=4096)
    assert resumed.snapshot == clean.snapshot == planned.snapshot
    for split in ("train", "val"):
        assert split_stream(Path(resumed.tokenized_dir), split) == split_stream(Path(clean.tokenized_dir), split)
    assert resumed.documents == clean.documents, "the report counts nothing twice"


def test_a_dry_run_shows_what_the_model_will_read_and_writes_nothing(tmp_path: Path) -> None:
    source = corpus_of_every_format(tmp_path / "corpus")
    root = tmp_path / "fsx"
    shown = run_cli(
        "stage-data",
        "--source",
        str(source),
        "--storage-root",
        str(root),
        "--dataset",
        "d",
        "--vocab-size",
        "300",
        "--val-fraction",
        "0.2",
        "--dry-run",
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "of 7 files sampled" in shown.stdout and "| jsonl.zst | 1 |" in shown.stdout
    assert "First train document of the parquet files" in shown.stdout
    first = next(
        t for k, r, t in expected_documents(source) if k.endswith(".parquet") and document_position(k, r) >= 0.2
    )
    assert first[:100] in shown.stdout
    assert not root.exists(), "a dry run writes nothing"


def test_the_command_line_refuses_bad_input_in_one_line_with_exit_code_2(tmp_path: Path) -> None:
    source = two_good_files(tmp_path / "a")
    (source / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    for dry_run in ([], ["--dry-run"]):
        result = run_cli(
            "stage-data", "--source", str(source), "--storage-root", str(tmp_path / "fsx"), "--dataset", "d", *dry_run
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert (
            result.stderr.strip()
            .splitlines()[-1]
            .endswith("photo.png: a PNG image, not text: leave it out with --exclude")
        )
    snapshots = DatasetPaths.of(tmp_path / "fsx", "d").snapshots
    assert not snapshots.exists() or not any(snapshots.iterdir())


def test_a_plain_text_corpus_stages_to_the_snapshot_it_had_before_documents_had_records(tmp_path: Path) -> None:
    """The same id, shards and tokenizer as the staging before formats (figures from commit c771005 on this very
    corpus), so a dataset staged then is found again, not re-tokenized; and a snapshot of then, whose meta.json has
    no padded vocabulary or BOS, gives its runs the model they had."""
    import hashlib

    from trainer.snapshot import model_vocab

    source = write_corpus(tmp_path / "c", files=4, sentences=20)
    result = stage_data(str(source), str(tmp_path / "fsx"), "d", vocab_size=300, val_fraction=0.25)
    snapshot = Path(result.tokenized_dir)
    meta = json.loads((snapshot / META).read_text())
    digest = hashlib.sha256(
        b"".join((snapshot / s["file"]).read_bytes() for split in ("train", "val") for s in meta["shards"][split])
    )
    assert result.snapshot == "66e598da93a24e62" and (result.train_tokens, result.val_tokens) == (1049, 385)
    assert digest.hexdigest() == "cae5c98f4fc0bf94f5ece31cee23f91dbfd7297c426ce050ebea5c0b7afd55f1"
    assert hashlib.sha256((snapshot / TOKENIZER).read_bytes()).hexdigest()[:16] == "e91a0fdb6b602062"
    assert model_vocab({"vocab_size": 300}) == 300 and model_vocab(meta) == 320


def test_invalid_utf8_in_plain_text_is_replaced_and_counted(tmp_path: Path) -> None:
    source = tmp_path / "plain"
    source.mkdir()
    (source / "a.txt").write_bytes(b"caf\xe9 au lait\n" * 3 + b"ok\xff\xfe\n")
    (source / "b.txt").write_text("the node saves the rank.\n" * 40)
    result = stage_data(str(source), str(tmp_path / "fsx"), "utf8", vocab_size=300, val_fraction=0.2)
    assert result.documents["replaced_bytes"] == 5
    texts = decoded_documents(Path(result.tokenized_dir), "train") + decoded_documents(
        Path(result.tokenized_dir), "val"
    )
    assert "caf\ufffd au lait\n" * 3 + "ok\ufffd\ufffd\n" in texts

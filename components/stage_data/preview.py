"""`stage-data --dry-run`: what staging would find and what the model would read, from a sample of the source, with
nothing written under the storage root. Each sampled file's format is detected and checked as staging does; its
documents are encoded with the given tokenizer (or one trained on the sample) and reported as the staging report
reports the whole corpus: documents and tokens per format, skipped records by cause, tokens per document, and each
format's first train document as the model would read it (decoded from its token ids)."""

from __future__ import annotations

import hashlib
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.stage_data import report
from components.stage_data.core import open_source
from components.stage_data.formats import check_file, detect, reader_for
from components.stage_data.formats.reader import Skipped
from components.stage_data.settings import StageSettings
from components.stage_data.sources import select
from components.stage_data.tokenization.plan import BLOCK_BYTES, load_given
from components.stage_data.tokenization.snapshot import BY_DOCUMENT, Entry, document_position
from components.stage_data.tokenizer import EOS, Specials, read_given, train_tokenizer

log = logging.getLogger(__name__)

SAMPLE_FILES = 8  # files read for a dry run, spread over the source by a hash of their keys
SAMPLE_BYTES = 32 * 2**20  # of text, at most, over all sampled files


@dataclass
class Preview:
    files: int  # selected in the source
    sampled: list[str]  # the keys read
    tokenizer: str  # where it came from
    specials: dict[str, Any]
    documents: dict[str, Any]  # report.summary of the sample

    def lines(self) -> list[str]:
        bos = f"BOS {self.specials['bos']} + " if self.specials["bos"] else ""
        return [
            f"## Dry run: {len(self.sampled)} of {self.files:,} files sampled ({', '.join(self.sampled)})",
            "",
            f"Tokenizer: {self.tokenizer}; each document is written as {bos}text + EOS {self.specials['eos']}.",
            "",
            *report.markdown(self.documents),
        ]


def dry_run(settings: StageSettings, sample_files: int = SAMPLE_FILES, sample_bytes: int = SAMPLE_BYTES) -> Preview:
    settings.check()
    given = read_given(settings.tokenizer_path, settings.endpoint_url) if settings.tokenizer_path else None
    src = open_source(settings.source, settings.endpoint_url, settings.workers, settings.chunk_size_mb)
    try:
        objects = select(src.list(), settings.source, settings.include, settings.exclude)
        chosen = sorted(objects, key=lambda o: hashlib.sha256(o.key.encode()).digest())[:sample_files]
        with tempfile.TemporaryDirectory(prefix="hpp-dry-run-") as tmp:
            paths = {}
            for obj in chosen:
                if obj.location and Path(obj.location).is_file() and not settings.source.startswith("s3://"):
                    paths[obj.key] = Path(obj.location)  # a local source is read where it is
                else:
                    paths[obj.key] = Path(tmp, hashlib.sha256(obj.key.encode()).hexdigest())
                    with open(paths[obj.key], "w+b") as out:
                        src.fetch(obj, out, lambda _: None)
            return _preview(settings, given, len(objects), paths, sample_bytes)
    finally:
        src.close()


def _preview(settings: StageSettings, given, files: int, paths: dict[str, Path], sample_bytes: int) -> Preview:
    formats = {}
    for key, path in paths.items():
        formats[key] = detect(path, key)
        check_file(path, key, formats[key], settings.field_path, settings.dataset)
    if settings.text_field and not any(f.records for f in formats.values()):
        raise InputError(
            f"text field {settings.text_field!r}: the sampled files are plain text, where a whole file "
            "is the document: leave text_field out, or stage JSON Lines or Parquet"
        )
    documents = []  # (format, split, text) of the sample, whole documents
    tally = report.Tally()
    taken = 0
    for key, path in paths.items():
        fmt = formats[key]
        entry = Entry(key, fmt, BY_DOCUMENT if fmt.records else "train")
        tally.format(fmt.name)["files"] += 1
        reader = reader_for(path, key, fmt, settings.field_path, BLOCK_BYTES)
        pieces: list[str] = []
        for part in range(reader.parts()):
            for item in reader.read(part):
                if isinstance(item, Skipped):
                    tally.skip(item.cause, item.where, item.bad)
                    continue
                pieces.append(item.text)
                taken += len(item.text.encode())
                if item.last or taken >= sample_bytes:
                    split = (
                        "val"
                        if entry.split == BY_DOCUMENT and document_position(key, item.record) < settings.val_fraction
                        else "train"
                    )
                    documents.append((fmt.name, split, "".join(pieces)))
                    pieces = []
                if taken >= sample_bytes:
                    break
            if taken >= sample_bytes:
                break
        tally.replaced_bytes += reader.replaced_bytes
    if given is not None:
        tokenizer, specials = load_given(given)
        where = settings.tokenizer_path
    else:
        tokenizer = train_tokenizer(iter([text for _, _, text in documents]), settings.vocab_size)
        specials = Specials(EOS, tokenizer.token_to_id(EOS))
        where = (
            f"a BPE tokenizer of {settings.vocab_size:,} trained on the sample (the staging trains one on up to "
            f"{settings.tokenizer_sample_mb:,} MB of the train split)"
        )
    previews = {}
    extra = 1 + (specials.bos_id is not None)
    encoded = tokenizer.encode_batch_fast([text for _, _, text in documents], add_special_tokens=False)
    for (name, split, text), encoding in zip(documents, encoded, strict=True):
        tally.document(name, split, len(encoding.ids) + extra)
        tally.format(name)["text_bytes"] += len(text.encode())
        if split == "train" and name not in previews:
            ids = ([specials.bos_id] if specials.bos_id is not None else []) + encoding.ids + [specials.eos_id]
            previews[name] = report.preview(tokenizer.decode(ids, skip_special_tokens=False))
    return Preview(files, list(paths), where, specials.to_dict(), report.summary(tally, previews))

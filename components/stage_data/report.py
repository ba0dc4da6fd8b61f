"""What a staging read and what the model will read: documents and tokens per file format, records skipped and
why, tokens per document, and each format's first train document as decoded back from the written shards.

Each encoding group keeps a Tally; its journal saves it with the shards' position, so a group that is killed and
carries on counts nothing twice; the finalize step adds the groups' tallies up for meta.json and the reports."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

EXAMPLES = 5  # positions of skipped and malformed records kept for the report
EXACT_BELOW = 128  # document lengths below this are counted exactly; above, in buckets 1% wide
PREVIEW_CHARS = 400  # of each first document, in the reports


def length_bucket(tokens: int) -> int:
    if tokens < EXACT_BELOW:
        return tokens
    return EXACT_BELOW + int(math.log(tokens / EXACT_BELOW) / math.log(1.01))


def bucket_floor(bucket: int) -> int:
    return bucket if bucket < EXACT_BELOW else round(EXACT_BELOW * 1.01 ** (bucket - EXACT_BELOW))


@dataclass
class Tally:
    formats: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> files, documents, tokens, text_bytes
    documents: dict[str, int] = field(default_factory=lambda: {"train": 0, "val": 0})
    skipped: dict[str, int] = field(default_factory=dict)  # cause -> records
    bad_records: int = 0  # malformed: not JSON, not an object, not UTF-8
    examples: list[str] = field(default_factory=list)  # "<where>: <cause>" of the first few skipped or malformed
    replaced_bytes: int = 0  # invalid UTF-8 (and lone surrogates) replaced by U+FFFD
    lengths: dict[int, int] = field(default_factory=dict)  # length bucket -> documents
    first: dict[str, dict[str, int]] = field(default_factory=dict)  # format -> {"group", "offset"} in the train split

    def format(self, name: str) -> dict[str, int]:
        return self.formats.setdefault(name, {"files": 0, "documents": 0, "tokens": 0, "text_bytes": 0})

    def skip(self, cause: str, where: str, bad: bool) -> None:
        self.skipped[cause] = self.skipped.get(cause, 0) + 1
        self.bad_records += bad
        if len(self.examples) < EXAMPLES:
            self.examples.append(f"{where}: {cause}")

    def document(self, fmt: str, split: str, tokens: int) -> None:
        self.documents[split] += 1
        counts = self.format(fmt)
        counts["documents"] += 1
        counts["tokens"] += tokens
        bucket = length_bucket(tokens)
        self.lengths[bucket] = self.lengths.get(bucket, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Tally:
        tally = cls(**{**data, "lengths": {int(k): v for k, v in data.get("lengths", {}).items()}})
        return tally

    def add(self, other: Tally, group: int | None = None) -> None:
        """Another group's counts after this one's."""
        for name, counts in other.formats.items():
            mine = self.format(name)
            for key, value in counts.items():
                mine[key] += value
        for split, count in other.documents.items():
            self.documents[split] += count
        self.skipped = dict(Counter(self.skipped) + Counter(other.skipped))
        self.bad_records += other.bad_records
        self.examples = (self.examples + other.examples)[:EXAMPLES]
        self.replaced_bytes += other.replaced_bytes
        self.lengths = dict(Counter(self.lengths) + Counter(other.lengths))
        for name, where in other.first.items():
            self.first.setdefault(name, where if group is None else {**where, "group": group})

    def percentile(self, q: float) -> int:
        """Tokens per document at quantile q (buckets above 128 tokens are 1% wide)."""
        total = sum(self.lengths.values())
        if not total:
            return 0
        seen = 0
        for bucket in sorted(self.lengths):
            seen += self.lengths[bucket]
            if seen >= q * total:
                return bucket_floor(bucket)
        return bucket_floor(max(self.lengths))


def summary(tally: Tally, previews: dict[str, str]) -> dict[str, Any]:
    """What meta.json and the reports say of the documents."""
    return {
        "formats": tally.formats,
        "documents": tally.documents,
        "skipped": tally.skipped,
        "bad_records": tally.bad_records,
        "examples": tally.examples,
        "replaced_bytes": tally.replaced_bytes,
        "tokens_per_document": {"median": tally.percentile(0.5), "p99": tally.percentile(0.99)},
        "first_documents": previews,
    }


def markdown(documents: dict[str, Any]) -> list[str]:
    """The documents' part of a staging report (KFP Markdown)."""
    lines = ["| format | files | documents | tokens | text MB |", "|---|---:|---:|---:|---:|"]
    for name, c in sorted(documents["formats"].items()):
        mb = c["text_bytes"] / 1e6
        lines.append(f"| {name} | {c['files']:,} | {c['documents']:,} | {c['tokens']:,} | {mb:,.1f} |")
    per_doc, split = documents["tokens_per_document"], documents["documents"]
    lines += [
        "",
        f"Tokens per document: median {per_doc['median']:,}, p99 {per_doc['p99']:,}. "
        f"Documents: {split['train']:,} train, {split['val']:,} val.",
    ]
    if documents["skipped"]:
        causes = ", ".join(f"{count:,} {cause}" for cause, count in sorted(documents["skipped"].items()))
        lines += ["", f"Skipped records: {causes} (first: {'; '.join(documents['examples'])})."]
    if documents["replaced_bytes"]:
        lines += ["", f"Invalid UTF-8: {documents['replaced_bytes']:,} bytes replaced by U+FFFD."]
    for name, text in sorted(documents["first_documents"].items()):
        lines += [
            "",
            f"First train document of the {name} files, as the model reads it (decoded from the shards):",
            "",
            "```",
            text.replace("```", "`\u200b``"),
            "```",
        ]
    return lines


def details(documents: dict[str, Any]) -> dict[str, str]:
    """The documents in a few words each, for the run summary's line of the finalize step."""
    if not documents:
        return {}
    formats = ", ".join(
        f"{name} {c['documents']:,} ({c['tokens']:,} tokens)" for name, c in sorted(documents["formats"].items())
    )
    skipped = ", ".join(f"{n:,} {cause}" for cause, n in sorted(documents["skipped"].items())) or "none"
    per_document = "median {median:,}, p99 {p99:,}".format(**documents["tokens_per_document"])
    return {"documents": formats, "skipped_records": skipped, "tokens_per_document": per_document}


def preview(text: str) -> str:
    return text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + f" … ({len(text):,} characters)"

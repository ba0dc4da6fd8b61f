"""What every format's reader yields and how it is read: a file's documents, a part at a time. Its own module, so that
the readers (json_lines.py, parquet.py, plain_text.py) and the package that picks one (__init__.py) both import it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Piece:
    """Text of one document, in order; a document may come in several pieces (a large plain-text file)."""

    text: str
    record: int  # the document's number in its file: with the file's key, it chooses the document's split
    first: bool  # the document's first piece: a beginning-of-document token goes before it
    last: bool  # its last: the end-of-document token goes after it


@dataclass(frozen=True)
class Skipped:
    """A record that is not a document: no text (missing, null, empty, not a string), or malformed (bad)."""

    record: int
    cause: str
    where: str  # "<key>:<line>" or "<key> row <n>", for the report and the refusal
    bad: bool = False


class Reader(Protocol):
    """One file's documents, a part at a time (a killed encode redoes at most one part)."""

    bytes_read: int  # of the file so far (compressed; Parquet: its row groups begun), for progress lines

    def parts(self) -> int: ...

    def read(self, part: int) -> Iterator[Piece | Skipped]: ...

"""Plain text (optionally gzip or zstd): each file is one document, read in blocks cut at line ends so that memory
stays flat however large the file. Invalid UTF-8 is replaced (U+FFFD) and counted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from components.stage_data.formats.reader import Piece
from components.stage_data.formats.streams import byte_chunks


class PlainTextReader:
    def __init__(self, path: Path, key: str, compression: str, block_bytes: int):
        self.path, self.key, self.compression, self.block_bytes = path, key, compression, block_bytes
        self.replaced_bytes = 0  # invalid UTF-8 bytes replaced so far
        self.bytes_read = 0  # of the file (compressed), for progress lines

    def parts(self) -> int:
        return 1

    def read(self, part: int = 0) -> Iterator[Piece]:
        first = True
        pending: str | None = None  # held back one block, to know which block is the last
        for block in self._blocks():
            if pending is not None:
                yield Piece(pending, 0, first, False)
                first = False
            pending = block
        yield Piece(pending or "", 0, first, True)  # an empty file is still a document: its end token alone

    def _blocks(self) -> Iterator[str]:
        """Blocks of about block_bytes, each ending at a newline (UTF-8 safe: '\\n' is one byte, never inside a
        character), but a line longer than four blocks is cut where it stands."""
        carry = b""
        for chunk in byte_chunks(self.path, self.compression, self.key, self._count):
            carry += chunk
            while len(carry) >= self.block_bytes:
                cut = carry.rfind(b"\n", 0, self.block_bytes) + 1 or carry.find(b"\n", self.block_bytes) + 1
                if cut == 0:  # no line end yet
                    if len(carry) < 4 * self.block_bytes:
                        break
                    cut = 4 * self.block_bytes
                    while carry[cut] & 0xC0 == 0x80:  # not inside a character
                        cut -= 1
                block, carry = carry[:cut], carry[cut:]
                yield self._decode(block)
        if carry:
            yield self._decode(carry)

    def _count(self, size: int) -> None:
        self.bytes_read += size

    def _decode(self, data: bytes) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            escaped = data.decode("utf-8", errors="surrogateescape")  # one lone surrogate per invalid byte
            self.replaced_bytes += sum(1 for c in escaped if "\udc80" <= c <= "\udcff")
            return data.decode("utf-8", errors="replace")

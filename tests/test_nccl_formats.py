"""NCCL's format strings in tests/nccl_formats.py, checked against the real libnccl.so of each version.

Why: the NCCL log fixtures (tests/nccl_logs.py) are rendered from tests/nccl_formats.py, and verify_nccl's parser is
tested against those fixtures. If a format there were misread (a missing "%s:%d" before "NCCL WARN", "Bootstrap :"
versus "Bootstrap:", ...), the generator would repeat our misreading and the parser tests would still pass. So every
literal of `NcclFormats.library_strings()` must occur byte for byte in that version's compiled library; a negative
control shows that the check does fail on a literal the library lacks (the WARN prefix our old parser assumed).

Source: the `nvidia-nccl-cu12` wheels on PyPI, one per version, pinned below by file name and sha256 (a wheel whose
sha256 differs fails the test: the pin is the point). The library is `nvidia/nccl/lib/libnccl.so.2` inside the wheel,
streamed out of the zip in chunks, never written to disk.

Cache and skip: a wheel is looked up in $HYPERPOD_NCCL_WHEELS, else ~/.cache/hyperpod-pretrain/nccl-wheels. If it is
not there, it is fetched with `pip download` (190-350 MB each, 1.3 GB for all five) into that directory; if pip
cannot fetch it (no network, or the session's download budget is spent), the test is skipped, naming the wheel and
the directory to put it in. With the wheels cached the module takes a few seconds.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from io import BytesIO
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import pytest

from tests.nccl_formats import NCCL_VERSIONS

# version -> (wheel file name on PyPI, its sha256)
WHEELS: dict[str, tuple[str, str]] = {
    "2.18.3": (
        "nvidia_nccl_cu12-2.18.3-py3-none-manylinux1_x86_64.whl",
        "89cf220910c43e53df992f54f7aa2a35c6d606b077c9ae95b1f17c544d3ad3f3",
    ),
    "2.21.5": (
        "nvidia_nccl_cu12-2.21.5-py3-none-manylinux2014_x86_64.whl",
        "8579076d30a8c24988834445f8d633c697d42397e92ffc3f63fa26766d25e0a0",
    ),
    "2.23.4": (
        "nvidia_nccl_cu12-2.23.4-py3-none-manylinux2014_x86_64.whl",
        "b097258d9aab2fa9f686e33c6fe40ae57b27df60cedbd15d139701bb5509e0c1",
    ),
    "2.27.7": (
        "nvidia_nccl_cu12-2.27.7-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "de5ba5562f08029a19cb1cd659404b18411ed0d6c90ac5f52f30bf99ad5809aa",
    ),
    "2.32.3": (
        "nvidia_nccl_cu12-2.32.3-py3-none-manylinux_2_27_x86_64.whl",
        "bb94b2348e4861d5e8aa00b36c3d12d9bdf9c6369b82cbb723de0b582280a21c",
    ),
}
CACHE_ENV = "HYPERPOD_NCCL_WHEELS"
DEFAULT_CACHE = Path("~/.cache/hyperpod-pretrain/nccl-wheels")
# All downloads of a test session together get this long (1.3 GB in all): a slow network skips the rest, so
# the suite's time stays bounded on a machine without the cache.
DOWNLOAD_BUDGET_S = 300
CHUNK = 16 << 20
# The WARN prefix our old parser assumed ("[cudaDev] NCCL WARN "). No NCCL release has it: up to 2.25 the WARN
# literal is "\n%s:%d:%d [%d] %s:%d NCCL WARN " (the source location sits between "[%d]" and "NCCL WARN").
OLD_WARN_PREFIX = b"[%d] NCCL WARN "


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def platform_tags(filename: str) -> list[str]:
    """The wheel's platform tags (name-version-python-abi-platform.whl; a compressed tag set is dot-separated)."""
    return filename.removesuffix(".whl").split("-")[-1].split(".")


def _check_pin(path: Path, version: str) -> None:
    filename, expected = WHEELS[version]
    actual = sha256_of(path)
    assert actual == expected, (
        f"{path}: sha256 {actual}, but nvidia-nccl-cu12=={version} is pinned to {filename} with sha256 {expected}"
    )


@pytest.fixture(scope="session")
def download_deadline() -> float:
    return time.monotonic() + DOWNLOAD_BUDGET_S


def nccl_wheel(version: str, deadline: float) -> Path:
    """The pinned wheel of `version`: from the cache, else downloaded into it with pip before `deadline` (a
    time.monotonic()); skip if pip cannot."""
    filename, _ = WHEELS[version]
    cache = cache_dir()
    cached = cache / filename
    if cached.is_file():
        _check_pin(cached, version)
        return cached
    where = f"put {filename} in {cache} (or set {CACHE_ENV} to a directory holding it)"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        pytest.skip(f"{filename} is not cached and {cache} cannot be created ({e}); {where}")
    left = deadline - time.monotonic()
    if left <= 0:
        pytest.skip(
            f"{filename} is not in {cache} and the session's {DOWNLOAD_BUDGET_S} s for downloads is spent; {where}"
        )
    platforms = [f"--platform={tag}" for tag in platform_tags(filename)]
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            *platforms,
            "--python-version",
            "3.11",
            "--disable-pip-version-check",
            "--no-input",
            "-q",
            "-d",
            tmp,
            f"nvidia-nccl-cu12=={version}",
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            pytest.skip(f"{filename} is not in {cache} and pip download took over {left:.0f} s; {where}")
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"{filename} is not in {cache} and pip could not download it ({last}); {where}")
        downloaded = Path(tmp) / filename
        got = sorted(p.name for p in Path(tmp).iterdir())
        assert downloaded.is_file(), f"pip download nvidia-nccl-cu12=={version} gave {got}, not the pinned {filename}"
        _check_pin(downloaded, version)
        os.replace(downloaded, cached)
    return cached


def library_member(wheel: zipfile.ZipFile) -> str:
    """The wheel's libnccl.so (libnccl.so.2 if there are several)."""
    names = [n for n in wheel.namelist() if PurePosixPath(n).name.startswith("libnccl.so")]
    assert names, f"no libnccl.so* in {wheel.filename}"
    return min(names, key=lambda n: (not n.endswith("/libnccl.so.2"), n))


def missing_from(stream: BinaryIO, literals: Sequence[bytes], chunk: int = CHUNK) -> list[bytes]:
    """The literals that occur nowhere in the stream, read chunk by chunk (a chunk keeps the last bytes of the one
    before it, enough for a literal that straddles the boundary); stops reading once every literal is found."""
    missing = list(dict.fromkeys(literals))
    overlap = max((len(lit) for lit in missing), default=1) - 1
    tail = b""
    while missing and (block := stream.read(chunk)):
        window = tail + block
        missing = [lit for lit in missing if lit not in window]
        tail = window[max(0, len(window) - overlap) :]
    return missing


def missing_from_library(wheel: Path, literals: Sequence[bytes]) -> tuple[str, list[bytes]]:
    """The wheel's libnccl.so member, and the literals it does not contain."""
    with zipfile.ZipFile(wheel) as zf:
        member = library_member(zf)
        with zf.open(member) as lib:
            return member, missing_from(lib, literals)


def test_every_version_is_pinned() -> None:
    assert set(WHEELS) == set(NCCL_VERSIONS)
    for version, (filename, sha256) in WHEELS.items():
        assert filename.startswith(f"nvidia_nccl_cu12-{version}-py3-none-") and filename.endswith(".whl")
        assert len(sha256) == 64 and int(sha256, 16) >= 0


def test_scan_finds_literals_across_chunk_boundaries() -> None:
    data = b"\x00abc\x00NCCL INFO \x00xyz\x00"
    for chunk in range(1, len(data) + 1):
        assert missing_from(BytesIO(data), [b"NCCL INFO ", b"abc", b"xyz"], chunk) == []
        assert missing_from(BytesIO(data), [b"NCCL WARN ", b"abc"], chunk) == [b"NCCL WARN "]


@pytest.mark.parametrize("version", sorted(NCCL_VERSIONS, key=lambda v: tuple(map(int, v.split(".")))))
def test_formats_are_in_the_library(version: str, download_deadline: float) -> None:
    wheel = nccl_wheel(version, download_deadline)
    literals = NCCL_VERSIONS[version].library_strings()
    member, missing = missing_from_library(wheel, literals)
    assert not missing, (
        f"NCCL {version}: {len(missing)} of {len(literals)} literals of tests/nccl_formats.py are not in {member} "
        f"of {wheel.name}: " + ", ".join(repr(lit) for lit in missing)
    )


def test_the_check_can_fail(download_deadline: float) -> None:
    """Negative control: the old parser's WARN prefix is not in 2.21.5's library, and the scan says so (and only
    that), while that version's real WARN literal is found."""
    version = "2.21.5"
    literals = NCCL_VERSIONS[version].library_strings()
    assert b"\n%s:%d:%d [%d] %s:%d NCCL WARN " in literals
    _, missing = missing_from_library(nccl_wheel(version, download_deadline), [*literals, OLD_WARN_PREFIX])
    assert missing == [OLD_WARN_PREFIX]

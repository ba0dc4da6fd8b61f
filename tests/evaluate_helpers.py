"""What the evaluation's test modules (tests/test_evaluate*.py) share: small evaluations, short samples, the report's
tables read back."""

import html
import re
from typing import Any

import pytest

# Small evaluations, for tests of what is kept and compared rather than of the numbers: few val tokens, no export.
QUICK: dict[str, Any] = {"export": False, "max_tokens": 128}


@pytest.fixture
def short_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """2-token greedy samples: the samples (128 forward passes of the whole window) are most of a small
    evaluation's time on a CPU, and the gate and history tests do not read them."""
    monkeypatch.setattr("components.evaluate_checkpoint.measure.SAMPLE_TOKENS", 2)


def table(page: str, table_id: str) -> list[list[str]]:
    """A table of the report as rows of cell texts (header row first)."""
    body = re.search(f'<table id="{table_id}">(.*?)</table>', page, re.S)
    assert body, f"no table {table_id}"
    return [
        [html.unescape(c) for c in re.findall(r"<t[dh]>(.*?)</t[dh]>", row, re.S)]
        for row in re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S)
    ]

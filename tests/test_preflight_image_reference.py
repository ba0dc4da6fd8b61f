"""The image reference grammar the image check parses the trainer's image with."""

from __future__ import annotations

import pytest

from components.preflight.image_reference import parse_reference
from tests.preflight_helpers import ECR_IMAGE


@pytest.mark.parametrize(
    ("reference", "parts"),
    [
        ("ubuntu", ("", "ubuntu", "", "")),
        ("library/ubuntu:24.04", ("", "library/ubuntu", "24.04", "")),
        ("localhost:5000/trainer:dev_1", ("localhost:5000", "trainer", "dev_1", "")),
        ("nvcr.io/nvidia/pytorch:24.04-py3", ("nvcr.io", "nvidia/pytorch", "24.04-py3", "")),
        (ECR_IMAGE, ("123456789012.dkr.ecr.us-east-1.amazonaws.com", "hyperpod-pretrain-trainer", "1", "")),
        ("ghcr.io/a__b/c.d-e@sha256:" + "a" * 64, ("ghcr.io", "a__b/c.d-e", "", "sha256:" + "a" * 64)),
        ("[::1]:5000/x:v1@sha256:" + "0" * 64, ("[::1]:5000", "x", "v1", "sha256:" + "0" * 64)),
    ],
)
def test_well_formed_references(reference: str, parts: tuple[str, str, str, str]) -> None:
    got = parse_reference(reference)
    assert (got["domain"], got["path"], got["tag"], got["digest"]) == parts


@pytest.mark.parametrize(
    ("reference", "problem"),
    [
        ("", "it is empty"),
        ("https://nvcr.io/nvidia/pytorch:24.04", "a reference has no scheme (drop the https://)"),
        ("nvcr.io/nvidia/pytorch::24.04", "the tag is empty or has a ':'"),
        ("nvcr.io/nvidia/pytorch:", "the tag is empty or has a ':'"),
        ("nvcr.io/nvidia/pytorch:-rc1", "tag '-rc1' is not [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"),
        ("nvcr.io/nvidia/pytorch@sha256:abc", "digest 'sha256:abc' is not algorithm:hex (sha256:<64 hex digits>)"),
        ("nvcr.io/nvidia/pytorch@sha256:" + "a" * 40, "a sha256 digest has 64 hex digits, this one 40"),
        ("nvcr.io/nvidia/-pytorch:1", "repository path components are lowercase letters and digits separated by"),
        ("nvcr.io//pytorch:1", "repository path components are lowercase letters and digits separated by"),
    ],
)
def test_malformed_references(reference: str, problem: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_reference(reference)
    assert str(error.value).startswith(problem)

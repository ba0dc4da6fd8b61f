"""Staging from S3: boto3 over HTTP to a real S3-compatible server (moto's standalone server) on loopback."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from common.errors import InputError, StepFailed
from common.objects import safe_key
from components.stage_data.core import stage_data
from tests.helpers import snapshot_dir, write_corpus
from tests.s3_server import S3Server
from trainer.layout import META, DatasetPaths

pytestmark = pytest.mark.usefixtures("aws_env")

CHUNK_MB = 1  # a 3 MB object is a 3-part ranged download


def bucket_named(request: pytest.FixtureRequest) -> str:
    """A bucket of this test's own (S3 bucket names: 3-63 lowercase letters, digits and hyphens)."""
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")
    return f"t-{name[:40].strip('-')}-{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]}"


@pytest.fixture
def s3(s3_endpoint: str):
    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture
def bucket(s3, request: pytest.FixtureRequest) -> str:
    name = bucket_named(request)
    s3.create_bucket(Bucket=name)
    return name


def upload_corpus(s3, bucket: str, prefix: str, corpus: Path) -> dict[str, bytes]:
    objects = {}
    for path in sorted(p for p in corpus.rglob("*") if p.is_file()):
        key = path.relative_to(corpus).as_posix()
        objects[key] = path.read_bytes()
        s3.put_object(Bucket=bucket, Key=f"{prefix}{key}", Body=objects[key])
    return objects


def stage(endpoint: str, bucket: str, root: Path, prefix: str = "corpus", **kwargs):
    settings = dict(vocab_size=300, val_fraction=0.2, endpoint_url=endpoint, chunk_size_mb=CHUNK_MB, workers=4)
    return stage_data(f"s3://{bucket}/{prefix}", str(root), "d", **{**settings, **kwargs})


def mirrored(root: Path) -> dict[str, bytes]:
    raw = DatasetPaths.of(root, "d").raw
    return {p.relative_to(raw).as_posix(): p.read_bytes() for p in raw.rglob("*") if p.is_file()}


def test_mirrors_small_large_unicode_empty_and_markers(
    s3, bucket: str, s3_server: S3Server, s3_endpoint: str, tmp_path: Path
) -> None:
    expected = upload_corpus(s3, bucket, "corpus/", write_corpus(tmp_path / "src", files=40, sentences=20))
    # 3 MB, above the multipart threshold, uploaded in one PUT (so an MD5 ETag); every 256 KB differs, so a part
    # written at the wrong offset shows
    large = b"".join((b"the shard %02d streams to the volume.\n" % i) * (2**18 // 37) for i in range(12))
    assert len(large) > 2 * CHUNK_MB * 2**20
    extra = {"big/large.txt": large, "ünïcode dir/file with spaces.txt": b"the warm node saves.\n", "empty.txt": b""}
    for key, body in extra.items():
        s3.put_object(Bucket=bucket, Key=f"corpus/{key}", Body=body)
    s3.put_object(Bucket=bucket, Key="corpus/folder/", Body=b"")  # a console "folder": a directory marker
    s3.put_object(Bucket=bucket, Key="corpus-other/not-mine.txt", Body=b"outside the prefix")
    expected.update(extra)

    result = stage(s3_endpoint, bucket, tmp_path / "fsx", include=["*.txt"])
    assert mirrored(tmp_path / "fsx") == expected
    gets = [
        line for line in s3_server.log_file.read_text().splitlines() if f"GET /{bucket}/corpus/big/large.txt" in line
    ]
    assert len(gets) == 3, "the large object comes as 3 ranged GETs of a 1 MB chunk"
    assert (result.files, result.files_copied, result.files_skipped) == (len(expected), len(expected), 0)
    paths = DatasetPaths.of(tmp_path / "fsx", "d")
    manifest = json.loads(paths.manifest.read_text())
    etags = {e["key"]: e["etag"] for e in manifest["files"]}
    assert etags["empty.txt"].strip('"') == hashlib.md5(b"").hexdigest()
    assert manifest["source"] == f"s3://{bucket}/corpus" and not paths.staging_journal.exists()
    assert json.loads((snapshot_dir(tmp_path / "fsx", "d") / META).read_text())["tokens"]["train"] > 0
    assert list(paths.root.rglob(".*")) == [paths.staging_lock], "no temporary files left"


def test_rerun_copies_nothing_then_only_what_changed(s3, bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    upload_corpus(s3, bucket, "corpus/", write_corpus(tmp_path / "src", files=8, sentences=20))
    root = tmp_path / "fsx"
    first = stage(s3_endpoint, bucket, root)
    meta_before = (snapshot_dir(root, "d") / META).read_text()

    again = stage(s3_endpoint, bucket, root)
    assert (again.files_copied, again.files_skipped, again.files_deleted, again.tokenized) == (0, 8, 0, False)
    assert (snapshot_dir(root, "d") / META).read_text() == meta_before

    s3.put_object(Bucket=bucket, Key="corpus/part-a/doc 01.txt", Body=b"the changed node saves the rank.\n")
    s3.delete_object(Bucket=bucket, Key="corpus/part-b/doc 00.txt")
    changed = stage(s3_endpoint, bucket, root)
    assert (changed.files_copied, changed.files_skipped, changed.files_deleted, changed.tokenized) == (1, 6, 1, True)
    files = mirrored(root)
    assert files["part-a/doc 01.txt"] == b"the changed node saves the rank.\n"
    assert "part-b/doc 00.txt" not in files and len(files) == first.files - 1

    s3.delete_object(Bucket=bucket, Key="corpus/part-b/doc 02.txt")
    kept = stage(s3_endpoint, bucket, root, keep_deleted=True)
    assert kept.files_deleted == 0 and "part-b/doc 02.txt" in mirrored(root)


@pytest.mark.parametrize(
    "key, problem",
    [
        ("../escape.txt", "'..' segment"),
        ("a/../../escape.txt", "'..' segment"),
        ("a\\b.txt", "backslash"),
        ("a//b.txt", "empty path segment"),
    ],
    ids=["dotdot", "nested-dotdot", "backslash", "double-slash"],
)
def test_a_key_that_would_escape_is_refused_before_anything_is_written(
    s3, bucket: str, s3_endpoint: str, tmp_path: Path, key: str, problem: str
) -> None:
    s3.put_object(Bucket=bucket, Key="corpus/good.txt", Body=b"the node saves.\n")
    s3.put_object(Bucket=bucket, Key=f"corpus/{key}", Body=b"evil")
    with pytest.raises(InputError, match=re.escape(repr(key)) + ".*" + re.escape(problem)):
        stage(s3_endpoint, bucket, tmp_path / "fsx")
    assert not (tmp_path / "fsx").exists()


@pytest.mark.parametrize(
    "key", ["/abs.txt", "nul\x00.txt", "a/./b.txt", ".."], ids=["absolute", "nul", "dot", "bare-dotdot"]
)
def test_unsafe_keys_the_server_may_not_store_are_refused_too(key: str) -> None:
    with pytest.raises(InputError, match="refusing to stage it"):
        safe_key(key, "s3://b/p")


def test_missing_bucket_prefix_and_credentials(s3, bucket: str, s3_endpoint: str, tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "fsx"
    with pytest.raises(InputError, match="bucket no-such-bucket-here does not exist"):
        stage_data("s3://no-such-bucket-here/x", str(root), "d", endpoint_url=s3_endpoint)
    with pytest.raises(InputError, match="no objects under prefix 'missing/'"):
        stage(s3_endpoint, bucket, root, prefix="missing")
    s3.put_object(Bucket=bucket, Key="corpus/a.txt", Body=b"the node saves.\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(InputError, match="no AWS credentials found"):
        stage(s3_endpoint, bucket, root)
    assert not root.exists()


def test_access_denied_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that checks IAM: the user has no policy, so listing the bucket is denied."""
    with S3Server(tmp_path / "server.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"}) as server:
        admin = dict(endpoint_url=server.endpoint, region_name="us-east-1")
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="reader")  # the 3 unauthenticated actions: this, the key, the bucket
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        boto3.client("s3", **admin).create_bucket(Bucket="locked")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        with pytest.raises(InputError, match="access denied while listing s3://locked/corpus/"):
            stage_data("s3://locked/corpus", str(tmp_path / "fsx"), "d", endpoint_url=server.endpoint)
    assert not (tmp_path / "fsx").exists()


def test_an_unreachable_endpoint_fails_after_bounded_retries(tmp_path: Path) -> None:
    from tests.servers import free_port

    started = time.monotonic()
    with pytest.raises(StepFailed, match="cannot reach the S3 endpoint"):
        stage_data("s3://b/p", str(tmp_path / "fsx"), "d", endpoint_url=f"http://127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 60 and not (tmp_path / "fsx").exists()


def test_killed_mid_staging_then_rerun_copies_only_what_is_missing(
    s3, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    expected = upload_corpus(s3, bucket, "corpus/", write_corpus(tmp_path / "src", files=300, sentences=5))
    root = tmp_path / "fsx"
    paths = DatasetPaths.of(root, "d")
    command = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "stage-data",
        "--source",
        f"s3://{bucket}/corpus",
        "--storage-root",
        str(root),
        "--dataset",
        "d",
        "--endpoint-url",
        s3_endpoint,
        "--workers",
        "2",
        "--vocab-size",
        "300",
    ]
    staging = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and staging.poll() is None:
        if paths.staging_journal.exists() and len(paths.staging_journal.read_text().splitlines()) >= 30:
            break
        time.sleep(0.01)
    staging.send_signal(signal.SIGKILL)
    _, stderr = staging.communicate()
    assert staging.returncode == -signal.SIGKILL, f"staging ended before it was killed: {stderr[-2000:]}"
    assert not paths.manifest.exists() and paths.current_snapshot() is None, "nothing looks complete"
    journaled = {
        json.loads(line)["key"] for line in paths.staging_journal.read_text().splitlines() if line.endswith("}")
    }

    result = stage(s3_endpoint, bucket, root, workers=4)
    assert result.files == 300 and result.files_copied <= 300 - len(journaled)
    assert result.files_skipped >= len(journaled) >= 30
    assert mirrored(root) == expected
    assert not paths.staging_journal.exists() and not list(paths.raw.rglob(".*.part"))


def object_gets(s3_server: S3Server, bucket: str) -> int:
    """GETs of objects (not listings) of this test's bucket the server has answered so far."""
    return sum(f"GET /{bucket}/corpus/" in line for line in s3_server.log_file.read_text().splitlines())


def test_a_narrower_include_keeps_the_mirror_and_widening_it_again_downloads_nothing(
    s3, bucket: str, s3_server: S3Server, s3_endpoint: str, tmp_path: Path
) -> None:
    expected = upload_corpus(s3, bucket, "corpus/", write_corpus(tmp_path / "src", files=8, sentences=20))
    root = tmp_path / "fsx"
    full = stage(s3_endpoint, bucket, root)
    gets = object_gets(s3_server, bucket)
    assert gets == 8

    narrow = stage(s3_endpoint, bucket, root, include=["part-a/*"])
    assert (narrow.files, narrow.files_copied, narrow.files_deleted, narrow.files_retained) == (4, 0, 0, 4)
    assert mirrored(root) == expected, "nothing outside the filter is removed"
    manifest = json.loads(DatasetPaths.of(root, "d").manifest.read_text())
    assert [e["key"] for e in manifest["retained"]] == sorted(k for k in expected if k.startswith("part-b/"))

    wide = stage(s3_endpoint, bucket, root)
    assert (wide.files, wide.files_copied, wide.files_skipped, wide.files_retained) == (8, 0, 8, 0)
    assert wide.content_sha256 == full.content_sha256
    assert wide.snapshot == full.snapshot and not wide.tokenized, "the same content is the first snapshot again"
    assert wide.train_tokens == full.train_tokens
    assert object_gets(s3_server, bucket) == gets, "no object is downloaded again"


def test_outside_the_include_a_changed_object_is_not_trusted_and_a_deleted_one_goes(
    s3, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    expected = upload_corpus(s3, bucket, "corpus/", write_corpus(tmp_path / "src", files=8, sentences=20))
    root = tmp_path / "fsx"
    stage(s3_endpoint, bucket, root)
    stage(s3_endpoint, bucket, root, include=["part-a/*"])

    def rewrite_same_size(key: str) -> bytes:
        new = expected[key].replace(b"the", b"THE", 1)
        assert new != expected[key] and len(new) == len(expected[key])
        s3.put_object(Bucket=bucket, Key=f"corpus/{key}", Body=new)
        return new

    changed = rewrite_same_size("part-b/doc 00.txt")
    s3.delete_object(Bucket=bucket, Key="corpus/part-b/doc 02.txt")
    kept = stage(s3_endpoint, bucket, root, keep_deleted=True)
    assert (kept.files, kept.files_copied, kept.files_deleted) == (7, 1, 0), "the changed object is copied again"
    assert mirrored(root)["part-b/doc 00.txt"] == changed
    assert "part-b/doc 02.txt" in mirrored(root), "kept: keep_deleted"

    stale = rewrite_same_size("part-b/doc 04.txt")
    narrow = stage(s3_endpoint, bucket, root, include=["part-a/*"])
    assert (narrow.files, narrow.files_copied, narrow.files_deleted, narrow.files_retained) == (4, 0, 2, 2)
    assert not {"part-b/doc 02.txt", "part-b/doc 04.txt"} & mirrored(root).keys(), "gone, and changed in the source"

    wide = stage(s3_endpoint, bucket, root)
    assert (wide.files, wide.files_copied, wide.files_skipped, wide.files_deleted) == (7, 1, 6, 0)
    assert mirrored(root)["part-b/doc 04.txt"] == stale
    assert len(mirrored(root)) == 7


def test_a_parquet_corpus_and_a_tokenizer_directory_in_s3(s3, s3_endpoint: str, bucket: str, tmp_path: Path) -> None:
    """The corpus and the tokenizer both from S3: the tokenizer's configuration files beside its tokenizer.json give
    its BOS and EOS; a prefix without a tokenizer.json is refused in one line."""
    from tests.test_formats import corpus_of_every_format, decoded_documents, expected_documents
    from tests.tokenizer_kinds import make_tokenizer, save_pretrained

    corpus = corpus_of_every_format(tmp_path / "corpus")
    upload_corpus(s3, bucket, "corpus/", corpus)
    texts = [t for _, _, t in expected_documents(corpus)]
    upload_corpus(
        s3, bucket, "tokenizers/llama3/", save_pretrained("llama3", make_tokenizer("llama3", texts), tmp_path / "tok")
    )
    result = stage(s3_endpoint, bucket, tmp_path / "fsx", tokenizer_path=f"s3://{bucket}/tokenizers/llama3/")
    snapshot = Path(result.tokenized_dir)
    meta = json.loads((snapshot / META).read_text())
    assert (meta["bos"], meta["eos"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert sorted(decoded_documents(snapshot, "train") + decoded_documents(snapshot, "val")) == sorted(texts)
    with pytest.raises(InputError, match=r"tokenizer s3://.*/corpus/web: has no tokenizer.json"):
        stage(s3_endpoint, bucket, tmp_path / "fsx2", tokenizer_path=f"s3://{bucket}/corpus/web")

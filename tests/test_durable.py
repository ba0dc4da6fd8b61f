"""Durable checkpoint copies (trainer/durable.py) against a real S3-compatible server (moto's) on loopback.

The committed directories are plain files plus a commit.json in the trainer's format; the trainer's own code
writes the real ones (DCP files), which this module never reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from common.s3 import S3Settings
from tests.s3_server import S3Server
from tests.servers import free_port
from trainer.durable import COMMIT, CheckpointMirror, MirrorError

pytestmark = pytest.mark.usefixtures("aws_env")

CHUNK = 2**20  # a 3 MB file is a multipart upload (of one 5 MB part, S3's least) and a ranged download of 1 MB parts


@pytest.fixture
def s3(s3_endpoint: str):
    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture
def bucket(s3, request: pytest.FixtureRequest) -> str:
    """A bucket of this test's own."""
    name = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")
    name = f"d-{name[:40].strip('-')}-{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def settings(endpoint: str, **overrides) -> S3Settings:
    return S3Settings(**{"endpoint_url": endpoint, "workers": 4, "chunk_size": CHUNK, **overrides})


@pytest.fixture
def mirror(s3_endpoint: str, bucket: str):
    with CheckpointMirror(f"s3://{bucket}/ckpt/run-1", settings(s3_endpoint)) as m:
        yield m


def committed(checkpoints: Path, step: int, world_size: int = 2, seed: int = 0, large: bool = False) -> Path:
    """A committed checkpoint directory in the trainer's format: DCP-named files, a dot-file, an empty one, and
    commit.json last listing every other file with its size."""
    directory = checkpoints / f"step_{step:08d}"
    directory.mkdir(parents=True)
    files = {".metadata": f"metadata of step {step} seed {seed}\n".encode() * 7, "empty.bin": b""}
    for rank in range(world_size):
        body = bytes((rank * 7 + seed + i) % 251 for i in range(1000 + 97 * rank + step))
        files[f"__{rank}_0.distcp"] = body * (3 * CHUNK // len(body) + 1) if large and rank == 0 else body
        files[f"rank_{rank}.json"] = json.dumps({"rank": rank, "step": step}).encode()
    for name, body in files.items():
        (directory / name).write_bytes(body)
    commit = {
        "step": step,
        "world_size": world_size,
        "files": {n: len(b) for n, b in files.items()},
        "time": 1_700_000_000 + step,
    }
    (directory / COMMIT).write_text(json.dumps(commit))
    return directory


def tree(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def keys(s3, bucket: str, prefix: str = "") -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def requests(server: S3Server, method: str, bucket: str, after: int = 0) -> list[str]:
    """The paths of `method` requests to `bucket` in the server's log, from line `after` on."""
    lines = server.log_file.read_text().splitlines()[after:]
    return [m[1] for line in lines if (m := re.search(rf"{method} /{bucket}/(\S+) HTTP", line))]


def log_length(server: S3Server) -> int:
    return len(server.log_file.read_text().splitlines())


def test_upload_then_download_round_trips_every_byte_and_commit_goes_last(
    mirror: CheckpointMirror, s3, bucket: str, s3_server: S3Server, tmp_path: Path
) -> None:
    local = committed(tmp_path / "fsx" / "checkpoints", 100, large=True)
    assert (local / "__0_0.distcp").stat().st_size > 3 * CHUNK
    before = log_length(s3_server)
    mirror.upload(local)

    assert keys(s3, bucket) == sorted(f"ckpt/run-1/step_00000100/{p.name}" for p in local.iterdir())
    puts = [path.split("?")[0] for path in requests(s3_server, "PUT", bucket, before)]
    assert puts[-1] == "ckpt/run-1/step_00000100/commit.json" and puts.count(puts[-1]) == 1
    assert "ckpt/run-1/step_00000100/__0_0.distcp?uploads" in requests(s3_server, "POST", bucket, before)

    before = log_length(s3_server)
    fetched = mirror.download("step_00000100", tmp_path / "fresh" / "checkpoints")
    ranged = [p for p in requests(s3_server, "GET", bucket, before) if p == "ckpt/run-1/step_00000100/__0_0.distcp"]
    assert len(ranged) == 4, "a ranged download of 1 MB parts"
    assert fetched == tmp_path / "fresh" / "checkpoints" / "step_00000100"
    assert tree(fetched) == tree(local)
    assert os.listdir(tmp_path / "fresh" / "checkpoints") == ["step_00000100"], "no temporary directory left"


def test_uploading_again_is_idempotent_and_another_attempts_copy_replaces_it(
    mirror: CheckpointMirror, s3, bucket: str, s3_server: S3Server, tmp_path: Path
) -> None:
    first = committed(tmp_path / "a", 200, world_size=3)
    mirror.upload(first)
    before = log_length(s3_server)
    mirror.upload(first)
    assert requests(s3_server, "PUT", bucket, before) == [], "a complete, identical copy is not uploaded again"

    # Another attempt reached the same step on 2 ranks (a resize): its copy replaces the 3-rank one whole.
    second = committed(tmp_path / "b", 200, world_size=2, seed=5)
    mirror.upload(second)
    assert keys(s3, bucket) == sorted(f"ckpt/run-1/step_00000200/{p.name}" for p in second.iterdir())
    assert tree(mirror.download("step_00000200", tmp_path / "back")) == tree(second)


def test_newest_complete_skips_a_copy_without_its_commit(
    mirror: CheckpointMirror, s3, bucket: str, tmp_path: Path
) -> None:
    assert mirror.newest_complete() is None
    checkpoints = tmp_path / "checkpoints"
    for step in (100, 200, 1000):
        mirror.upload(committed(checkpoints, step))
    assert mirror.newest_complete() == "step_00001000", "by step, not by listing order"
    s3.delete_object(Bucket=bucket, Key="ckpt/run-1/step_00001000/commit.json")  # its upload was interrupted
    s3.put_object(Bucket=bucket, Key="ckpt/run-1/.step_00002000.tmp/x", Body=b"not a checkpoint")
    s3.put_object(Bucket=bucket, Key="ckpt/run-10/step_00003000/commit.json", Body=b"{}")  # another run's prefix
    assert mirror.newest_complete() == "step_00000200"
    with pytest.raises(MirrorError, match=r"no complete copy of step_00001000 \(s3://.*/commit.json does not exist"):
        mirror.download("step_00001000", tmp_path / "back")
    assert not (tmp_path / "back" / "step_00001000").exists()


def test_a_refused_upload_leaves_no_commit_and_the_previous_copy_stays_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that checks IAM: the role may write everything but one file, so one PUT fails mid-upload."""
    with S3Server(tmp_path / "server.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"}) as server:
        admin = dict(endpoint_url=server.endpoint, region_name="us-east-1")
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="trainer")  # the 4 unauthenticated actions: this, the policy, the key, the bucket
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
                {
                    "Effect": "Deny",
                    "Action": "s3:PutObject",
                    "Resource": "arn:aws:s3:::locked/run/step_00000200/__1_0*",
                },
            ],
        }
        iam.put_user_policy(UserName="trainer", PolicyName="p", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        boto3.client("s3", **admin).create_bucket(Bucket="locked")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        with CheckpointMirror("s3://locked/run", settings(server.endpoint)) as mirror:
            mirror.upload(committed(tmp_path, 100))
            with pytest.raises(MirrorError) as failed:
                mirror.upload(committed(tmp_path, 200))
            assert mirror.newest_complete() == "step_00000100"
            stored = keys(boto3.session.Session().client("s3", **admin), "locked", "run/step_00000200/")
    message = str(failed.value)
    assert message.startswith("checkpoint mirror s3://locked/run: access denied while uploading ")
    assert "s3:PutObject" in message and "\n" not in message
    assert stored and "run/step_00000200/commit.json" not in stored


def test_a_copy_with_a_wrong_size_or_a_missing_file_fails_by_name_and_leaves_nothing(
    mirror: CheckpointMirror, s3, bucket: str, tmp_path: Path
) -> None:
    mirror.upload(committed(tmp_path / "fsx", 300))
    into = tmp_path / "back"
    (into / ".step_00000300.download.tmp").mkdir(parents=True)  # left by a download killed before
    (into / ".step_00000300.download.tmp" / "junk").write_bytes(b"x")

    s3.put_object(Bucket=bucket, Key="ckpt/run-1/step_00000300/__1_0.distcp", Body=b"shorter than before")
    with pytest.raises(MirrorError) as wrong:
        mirror.download("step_00000300", into)
    assert str(wrong.value) == (
        f"checkpoint mirror s3://{bucket}/ckpt/run-1: s3://{bucket}/ckpt/run-1/step_00000300/"
        f"__1_0.distcp has 19 bytes, its commit.json says 1397 bytes"
    )
    assert os.listdir(into) == [], "neither the checkpoint nor the temporary directory"

    s3.delete_object(Bucket=bucket, Key="ckpt/run-1/step_00000300/.metadata")
    with pytest.raises(MirrorError, match=r"step_00000300/\.metadata is missing, its commit\.json says \d+ bytes"):
        mirror.download("step_00000300", into)
    assert os.listdir(into) == []


def test_a_download_replaces_a_damaged_local_copy(mirror: CheckpointMirror, tmp_path: Path) -> None:
    local = committed(tmp_path / "fsx", 400)
    mirror.upload(local)
    into = tmp_path / "node" / "checkpoints"
    (into / "step_00000400").mkdir(parents=True)
    (into / "step_00000400" / "__0_0.distcp").write_bytes(b"truncated")
    assert tree(mirror.download("step_00000400", into)) == tree(local)
    assert os.listdir(into) == ["step_00000400"]


def test_prune_deletes_other_steps_commit_first_and_nothing_else(
    mirror: CheckpointMirror, s3, bucket: str, tmp_path: Path
) -> None:
    for step in (100, 200, 300, 400):
        mirror.upload(committed(tmp_path / "fsx", step))
    s3.delete_object(Bucket=bucket, Key="ckpt/run-1/step_00000400/commit.json")  # an interrupted upload
    s3.put_object(Bucket=bucket, Key="ckpt/run-1/notes.txt", Body=b"not a checkpoint")
    s3.put_object(Bucket=bucket, Key="ckpt/run-2/step_00000100/commit.json", Body=b"{}")  # another run's
    deletes: list[list[str]] = []
    mirror._s3.client.meta.events.register(  # observes the requests; the server does the deleting
        "before-parameter-build.s3.DeleteObjects",
        lambda params, **_: deletes.append([o["Key"] for o in params["Delete"]["Objects"]]),
    )

    mirror.prune({"step_00000200", "step_00000300"})
    assert mirror.newest_complete() == "step_00000300"
    remaining = keys(s3, bucket)
    assert {k.split("/")[2] for k in remaining if k.startswith("ckpt/run-1/")} == {
        "step_00000200",
        "step_00000300",
        "notes.txt",
    }
    assert "ckpt/run-2/step_00000100/commit.json" in remaining
    for step in ("step_00000100", "step_00000400"):
        mine = [i for i, batch in enumerate(deletes) if any(f"/{step}/" in k for k in batch)]
        assert deletes[mine[0]] == [f"ckpt/run-1/{step}/commit.json"] and len(mine) == 2, "commit.json alone, first"
    mirror.prune({"step_00000200", "step_00000300"})  # nothing more to do
    assert keys(s3, bucket) == remaining


@pytest.mark.parametrize(
    "uri, problem",
    [
        ("bucket/prefix", "not an S3 URI"),
        ("s3://", "'' is not an S3 bucket name"),
        ("s3://Bad_Bucket/run", "'Bad_Bucket' is not an S3 bucket name"),
        ("s3://bucket/runs//r1", "the prefix has an empty, '.' or '..' segment"),
        ("s3://bucket/runs/../r1", "the prefix has an empty, '.' or '..' segment"),
        ("s3://bucket/runs/r 1", "the prefix has a space"),
    ],
)
def test_a_bad_uri_is_one_line_naming_it(uri: str, problem: str) -> None:
    with pytest.raises(MirrorError) as bad:
        CheckpointMirror(uri)
    assert str(bad.value).startswith(f"checkpoint mirror {uri!r}: {problem}") and "\n" not in str(bad.value)


def test_bad_step_names_and_uncommitted_directories_are_refused(mirror: CheckpointMirror, tmp_path: Path) -> None:
    with pytest.raises(MirrorError, match=r"'\.\./step_00000001' is not a checkpoint directory name"):
        mirror.download("../step_00000001", tmp_path)
    uncommitted = committed(tmp_path, 500)
    (uncommitted / COMMIT).unlink()
    with pytest.raises(MirrorError, match=r"step_00000500 is not a committed checkpoint \(cannot read its commit"):
        mirror.upload(uncommitted)
    torn = committed(tmp_path / "torn", 600)
    (torn / "__1_0.distcp").write_bytes(b"cut")
    with pytest.raises(MirrorError, match=r"__1_0\.distcp has 3 bytes, its commit\.json says 1697"):
        mirror.upload(torn)
    assert mirror.newest_complete() is None


def test_an_unreachable_endpoint_and_a_missing_bucket_are_one_line(s3_endpoint: str, tmp_path: Path) -> None:
    started = time.monotonic()
    unreachable = settings(f"http://127.0.0.1:{free_port()}", max_attempts=2, connect_timeout_s=2)
    with CheckpointMirror("s3://bucket/run", unreachable) as mirror, pytest.raises(MirrorError) as failed:
        mirror.newest_complete()
    assert str(failed.value).startswith("checkpoint mirror s3://bucket/run: cannot reach the S3 endpoint while listing")
    assert time.monotonic() - started < 30
    with CheckpointMirror("s3://no-such-bucket-here/run", settings(s3_endpoint)) as mirror:
        with pytest.raises(
            MirrorError,
            match=r"^checkpoint mirror s3://no-such-bucket-here/run: bucket "
            r"no-such-bucket-here does not exist$",
        ):
            mirror.upload(committed(tmp_path, 700))


def test_the_module_imports_neither_kfp_nor_kubernetes() -> None:
    """The trainer image installs no kfp or kubernetes."""
    code = (
        "import sys, trainer.durable; bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('kfp', 'kubernetes')); print(bad); sys.exit(bool(bad))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _resume_from_the_copy(rank: int, store: str, uri: str, endpoint: str, run_dir: str, steps: list) -> None:
    """One rank of a resume whose volume lost its checkpoints: rank 1 looks only after rank 0 has fetched the copy
    (the worst case of ranks that start at different times), then both go on to the next collective."""
    import datetime

    import torch
    import torch.distributed as dist

    from trainer.checkpoint import CheckpointManager

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20)
    )
    try:
        with CheckpointMirror(uri, settings(endpoint)) as mirror:
            manager = CheckpointManager(Path(run_dir), mirror=mirror)
            if rank == 1:
                deadline = time.monotonic() + 30
                while not (Path(run_dir) / "step_00000020" / COMMIT).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            found = manager.newest()
            dist.all_reduce(torch.ones(1))  # ranks out of step would meet here in different collectives
            steps[rank] = found.step if found else None
    finally:
        dist.destroy_process_group()


def test_every_rank_waits_for_the_fetch_of_a_durable_copy_whoever_looks_late(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    uri = f"s3://{bucket}/ckpt/run-1"
    with CheckpointMirror(uri, settings(s3_endpoint)) as mirror:
        mirror.upload(committed(tmp_path / "elsewhere", 20))
    run_dir = tmp_path / "run" / "checkpoints"
    run_dir.mkdir(parents=True)
    with mp.Manager() as manager:
        steps = manager.list([None, None])
        mp.start_processes(
            _resume_from_the_copy,
            args=(str(tmp_path / "store"), uri, s3_endpoint, str(run_dir), steps),
            nprocs=2,
            start_method="spawn",
        )
        assert list(steps) == [20, 20]

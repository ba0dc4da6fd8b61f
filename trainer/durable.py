"""Durable copies of committed checkpoints in S3, and the newest one fetched back.

FSx for Lustre is the fast place for checkpoints, not a safe one (a scratch file system, a volume deleted with its
cluster). A committed checkpoint directory (`<run>/checkpoints/step_NNNNNNNN/`, complete when its `commit.json`
exists) is copied to `s3://bucket/<prefix>/step_NNNNNNNN/` with the same rule: every other file is uploaded and its
size checked in a listing before `commit.json` goes up, so a copy in S3 is complete exactly when its commit.json
exists. Pruning deletes commit.json first, for the same reason. A download lands under a dot-name, is checked
against the copy's commit.json, fsynced, and renamed into place whole.

The S3 client is the one staging uses (common.s3): connect and read timeouts, botocore's standard retry mode
(throttling, 5xx and connection errors, a bounded number of attempts, nothing else), s3transfer for multipart
uploads and ranged downloads, and its download verification (size, and the MD5 of single-part objects against
their ETag, every GET pinned to the listed ETag). botocore also sends a CRC32 checksum with every PUT and part,
which S3 checks before it stores the bytes. Nothing from components/ or pipelines/ (no kfp or kubernetes): the
trainer image has only trainer/ and common/.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from common.errors import InputError, StepFailed
from common.objects import SourceObject
from common.s3 import S3Settings, S3Source, list_exact
from trainer.atomic import fsync_dir, replace_dir
from trainer.layout import CHECKPOINT_COMMIT as COMMIT
from trainer.layout import CHECKPOINT_STEP_DIR as STEP_DIR

log = logging.getLogger(__name__)

DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_ACCESS_DENIED = ("AccessDenied", "AllAccessDisabled", "403", "Forbidden")
_NOT_FOUND = ("404", "NoSuchKey", "NotFound")


class MirrorError(StepFailed):
    """Anything CheckpointMirror could not do, bad URI included: one line naming the URI (or object) and what."""


def parse_mirror_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without a trailing slash; may be empty)."""
    if not uri.startswith("s3://"):
        raise MirrorError(f"checkpoint mirror {uri!r}: not an S3 URI (expected s3://bucket/prefix)")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not _BUCKET.match(bucket):
        raise MirrorError(
            f"checkpoint mirror {uri!r}: {bucket!r} is not an S3 bucket name (3-63 of a-z, 0-9, '.', '-')"
        )
    prefix = prefix.rstrip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise MirrorError(f"checkpoint mirror {uri!r}: the prefix has an empty, '.' or '..' segment")
    if any(c.isspace() or not c.isprintable() or c == "\\" for c in prefix):
        raise MirrorError(f"checkpoint mirror {uri!r}: the prefix has a space, control character or backslash")
    return bucket, prefix


def check_step_name(name: str, uri: str) -> None:
    if not STEP_DIR.match(name):
        raise MirrorError(f"checkpoint mirror {uri}: {name!r} is not a checkpoint directory name (step_NNNNNNNN)")


def read_commit(data: bytes, where: str) -> dict[str, int]:
    """The files a commit.json lists, {plain file name: size}, checked so they can be fetched into one directory."""
    try:
        files = json.loads(data)["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise MirrorError(f"{where}: not a commit.json with a 'files' object ({type(exc).__name__}: {exc})") from None
    if not isinstance(files, dict):
        raise MirrorError(f"{where}: 'files' is not an object of file names and sizes")
    for name, size in files.items():
        if not name or "/" in name or "\\" in name or name in (".", "..", COMMIT) or "\0" in name:
            raise MirrorError(f"{where}: lists {name!r}, which is not a file name in the checkpoint directory")
        if type(size) is not int or size < 0:
            raise MirrorError(f"{where}: the size of {name!r} is {size!r}, not a byte count")
    return files


class CheckpointMirror:
    """This run's checkpoints in S3: `uri` is `s3://bucket/prefix`, each step under `<prefix>/step_NNNNNNNN/`.

    Safe to call from a thread of its own (the boto3 client and s3transfer's manager are thread-safe); one call at a
    time per step directory.
    """

    def __init__(self, uri: str, settings: S3Settings | None = None):
        self.bucket, self.prefix = parse_mirror_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.settings = settings or S3Settings()
        try:
            self._s3 = S3Source(self.uri, self.settings)
        except (ValueError, BotoCoreError) as exc:  # e.g. an endpoint URL that is not a URL
            raise MirrorError(f"checkpoint mirror {self.uri}: cannot make an S3 client ({exc})") from None

    def close(self) -> None:
        self._s3.close()

    def __enter__(self) -> CheckpointMirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Keys and errors

    def _dir_key(self, name: str) -> str:
        return f"{self.prefix}/{name}/" if self.prefix else f"{name}/"

    def _key(self, name: str, file: str) -> str:
        return self._dir_key(name) + file

    def _error(self, exc: Exception, doing: str) -> MirrorError:
        """The staging client's mapping of an S3 error to one line, told as the mirror's."""
        where = f"checkpoint mirror {self.uri}"
        if isinstance(exc, MirrorError):
            return exc
        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code", "") in _ACCESS_DENIED:
            message = exc.response.get("Error", {}).get("Message", "") or str(exc)
            return MirrorError(
                f"{where}: access denied while {doing} (the trainer pods' IAM role needs "
                "s3:ListBucket on the bucket and s3:GetObject, s3:PutObject and s3:DeleteObject under "
                f"the prefix): {message}"
            )
        mapped = exc if isinstance(exc, (InputError, StepFailed)) else self._s3.fail(exc, doing)
        text = str(mapped).removeprefix(f"source {self.uri}: ")
        return MirrorError(f"{where}: {text}")

    # Reading S3

    def _listing(self, name: str) -> dict[str, SourceObject]:
        """The objects of one step directory: {name relative to it: its size and ETag}."""
        directory = self._dir_key(name)
        found = {}
        try:
            for page in self._s3.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=directory):
                for item in page.get("Contents", []):
                    relative = item["Key"][len(directory) :]
                    found[relative] = SourceObject(relative, item["Size"], item.get("ETag", ""), location=item["Key"])
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, f"listing s3://{self.bucket}/{directory}") from None
        return found

    def _step_dirs(self) -> list[str]:
        """The step directories under the prefix, oldest first (a listing by directory: no file is listed)."""
        base = f"{self.prefix}/" if self.prefix else ""
        names = []
        try:
            pages = self._s3.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/"
            )
            for page in pages:
                names += [p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, f"listing s3://{self.bucket}/{base}") from None
        return sorted(n for n in names if STEP_DIR.match(n))

    def _unless_missing(self, call: Callable[[], Any], doing: str) -> Any:
        """call()'s result; None when S3 answers that there is no such object."""
        try:
            return call()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _NOT_FOUND:
                return None
            raise self._error(exc, doing) from None
        except BotoCoreError as exc:
            raise self._error(exc, doing) from None

    def _get(self, key: str) -> bytes | None:
        """A small object's bytes; None when there is no such object."""

        def read() -> bytes:
            response = self._s3.client.get_object(Bucket=self.bucket, Key=key)
            with response["Body"] as body:
                return body.read()

        return self._unless_missing(read, f"reading s3://{self.bucket}/{key}")

    def _exists(self, key: str) -> bool:
        """By a listing (common.s3.list_exact): with the trainer's role a HeadObject of a missing key is a 403."""
        try:
            return list_exact(self._s3.client, self.bucket, key) is not None
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, f"looking for s3://{self.bucket}/{key}") from None

    def _delete(self, keys: list[str]) -> None:
        try:
            for start in range(0, len(keys), DELETE_BATCH):
                batch = [{"Key": key} for key in keys[start : start + DELETE_BATCH]]
                response = self._s3.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
                if response.get("Errors"):
                    first = response["Errors"][0]
                    raise MirrorError(
                        f"checkpoint mirror {self.uri}: could not delete s3://{self.bucket}/"
                        f"{first.get('Key')} ({first.get('Code')}: {first.get('Message')}), and "
                        f"{len(response['Errors']) - 1} more"
                    )
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, f"deleting {len(keys)} objects") from None

    # What the trainer calls

    def upload(self, committed: Path) -> None:
        """Copy a committed checkpoint directory: every file its commit.json lists, then commit.json.

        Idempotent: a copy already complete with the same commit.json and sizes is left alone; any other copy of
        the step (interrupted, or from another attempt that reached the same step) is uncommitted first, then
        overwritten, and objects the new commit.json does not list are deleted before it goes up.
        """
        committed = Path(committed)
        name = committed.name
        check_step_name(name, self.uri)
        started = time.monotonic()
        try:
            commit_bytes = (committed / COMMIT).read_bytes()
        except OSError as exc:
            raise MirrorError(
                f"checkpoint mirror {self.uri}: {committed} is not a committed checkpoint (cannot "
                f"read its {COMMIT}: {exc.strerror})"
            ) from None
        files = read_commit(commit_bytes, str(committed / COMMIT))
        for file, size in files.items():
            try:
                actual = (committed / file).stat().st_size
            except OSError as exc:
                raise MirrorError(
                    f"checkpoint mirror {self.uri}: {committed / file}, listed in its {COMMIT}, cannot "
                    f"be read ({exc.strerror})"
                ) from None
            if actual != size:
                raise MirrorError(
                    f"checkpoint mirror {self.uri}: {committed / file} has {actual} bytes, its {COMMIT} says {size}"
                )

        remote = self._listing(name)
        if COMMIT in remote:
            same = self._get(self._key(name, COMMIT)) == commit_bytes
            if same and all(file in remote and remote[file].size == size for file, size in files.items()):
                log.info("checkpoint %s is already in %s", name, self.uri)
                return
            log.info("replacing the copy of %s in %s (its %s differs)", name, self.uri, COMMIT)
            self._delete([self._key(name, COMMIT)])  # uncommitted before any of its files changes

        futures = [
            self._s3.transfers.upload(str(committed / file), self.bucket, self._key(name, file)) for file in files
        ]
        failure = None
        for future in futures:  # every transfer ends before this returns or raises: none writes behind our back
            try:
                future.result()
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise self._error(failure, f"uploading {committed}") from None
        stray = sorted(set(remote) - set(files) - {COMMIT})
        if stray:
            self._delete([self._key(name, file) for file in stray])

        uploaded = self._listing(name)
        for file, size in files.items():
            if file not in uploaded or uploaded[file].size != size:
                found = f"{uploaded[file].size} bytes" if file in uploaded else "missing"
                raise MirrorError(
                    f"checkpoint mirror {self.uri}: s3://{self.bucket}/{self._key(name, file)} is "
                    f"{found} after its upload, {size} expected"
                )
        try:
            self._s3.client.put_object(Bucket=self.bucket, Key=self._key(name, COMMIT), Body=commit_bytes)
        except (ClientError, BotoCoreError) as exc:
            raise self._error(exc, f"writing {self._key(name, COMMIT)}") from None
        total = sum(files.values())
        seconds = time.monotonic() - started
        log.info(
            "copied checkpoint %s to %s/%s: %d files, %.1f MB in %.1fs (%.1f MB/s)",
            name,
            self.uri,
            name,
            len(files) + 1,
            total / 1e6,
            seconds,
            total / 1e6 / max(seconds, 1e-9),
        )

    def newest_complete(self) -> str | None:
        """The newest step directory whose commit.json is in S3, or None."""
        for name in reversed(self._step_dirs()):
            if self._exists(self._key(name, COMMIT)):
                return name
            log.info("the copy of %s in %s has no %s (an interrupted upload): skipped", name, self.uri, COMMIT)
        return None

    def download(self, name: str, into: Path) -> Path:
        """Fetch the complete copy of step directory `name` to `into/<name>` (replacing one there) and return it.

        It lands in `into/.<name>.download.tmp/`, every file checked against the copy's commit.json, fsynced, and
        is renamed into place whole: on any failure nothing is left at `into/<name>`, nor the temporary directory.
        """
        check_step_name(name, self.uri)
        into = Path(into)
        tmp = into / f".{name}.download.tmp"
        started = time.monotonic()
        into.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a download killed before
        tmp.mkdir()
        try:
            commit_key = self._key(name, COMMIT)
            listing = self._listing(name)  # first: its commit.json is read only when listed (no GET of a missing key)
            commit_bytes = self._get(commit_key) if COMMIT in listing else None
            if commit_bytes is None:
                raise MirrorError(
                    f"checkpoint mirror {self.uri}: no complete copy of {name} (s3://{self.bucket}/"
                    f"{commit_key} does not exist)"
                )
            files = read_commit(commit_bytes, f"s3://{self.bucket}/{commit_key}")
            for file, size in files.items():
                found = listing.get(file)
                if found is None or found.size != size:
                    what = "is missing" if found is None else f"has {found.size} bytes"
                    raise MirrorError(
                        f"checkpoint mirror {self.uri}: s3://{self.bucket}/{self._key(name, file)} "
                        f"{what}, its {COMMIT} says {size} bytes"
                    )
            self._fetch_all([listing[file] for file in files], tmp)
            for file, size in files.items():
                if (actual := (tmp / file).stat().st_size) != size:  # fetch checked the listing; this, the commit
                    raise MirrorError(
                        f"checkpoint mirror {self.uri}: s3://{self.bucket}/{self._key(name, file)} "
                        f"arrived with {actual} bytes, its {COMMIT} says {size}"
                    )
            with open(tmp / COMMIT, "wb") as out:  # last, as when it was written: the copy is whole
                out.write(commit_bytes)
                out.flush()
                os.fsync(out.fileno())
            fsync_dir(tmp)
            final = into / name
            replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        total = sum(files.values())
        seconds = time.monotonic() - started
        log.info(
            "fetched checkpoint %s from %s: %d files, %.1f MB in %.1fs (%.1f MB/s)",
            name,
            self.uri,
            len(files) + 1,
            total / 1e6,
            seconds,
            total / 1e6 / max(seconds, 1e-9),
        )
        return final

    def _fetch_all(self, objects: list[SourceObject], into: Path) -> None:
        """Each object to `into/<its name>`, fsynced, `settings.workers` at a time; the first failure stops the rest."""

        def fetch(obj: SourceObject) -> None:
            with open(into / obj.key, "w+b") as out:
                try:
                    self._s3.fetch(obj, out, on_bytes=lambda _n: None)
                except (InputError, StepFailed) as exc:
                    raise self._error(exc, f"downloading {obj.location}") from None
                out.flush()
                os.fsync(out.fileno())

        with ThreadPoolExecutor(max_workers=self.settings.workers, thread_name_prefix="ckpt-fetch") as pool:
            futures = [pool.submit(fetch, obj) for obj in objects]
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                future.cancel()  # those not started yet; the running ones finish before the pool closes
        for future in futures:
            if not future.cancelled() and (exc := future.exception()) is not None:
                raise self._error(exc, "downloading")

    def prune(self, keep: set[str]) -> None:
        """Delete the copies of every step directory not in `keep`, each commit.json first (a copy half deleted is
        never taken for complete). Copies without a commit.json (interrupted uploads) go too, unless kept: call it
        once the uploads of the steps in `keep` have returned, not beside one still running."""
        for name in self._step_dirs():
            if name in keep:
                continue
            self._delete([self._key(name, COMMIT)])
            keys = [obj.location for file, obj in sorted(self._listing(name).items())]
            if keys:
                self._delete(keys)
            log.info("deleted the copy of %s from %s (%d objects)", name, self.uri, len(keys) + 1)

"""An S3 (or S3-compatible) prefix as a staging source, through boto3 and s3transfer; the trainer's checkpoint
copies (trainer/durable.py) use the same client.

Credentials come from the standard AWS chain (IRSA on EKS, AWS_PROFILE, the AWS_* variables); the endpoint
from --endpoint-url or AWS_ENDPOINT_URL. Every call has a connect and read timeout, and botocore's
"standard" retry mode retries throttling, 5xx and connection errors a bounded number of times and
nothing else. Objects below the multipart threshold are fetched with one GetObject each (the staging
pool runs many at once); larger ones go through s3transfer's ranged, parallel download. Every GET
carries the listed ETag as If-Match, so an object replaced after the listing fails instead of mixing.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    IncompleteReadError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from s3transfer.manager import TransferConfig, TransferManager
from s3transfer.subscribers import BaseSubscriber

from common.errors import InputError, StepFailed
from common.objects import SourceObject, copy_hashing, md5_of_etag, safe_key

log = logging.getLogger(__name__)

STREAM_ATTEMPTS = 3  # a body cut off mid-stream (after botocore's own retries of the request) is fetched again
_STREAM_ERRORS = (ReadTimeoutError, IncompleteReadError, ResponseStreamingError, ConnectionClosedError)
_KMS = ("aws:kms", "aws:kms:dsse")  # their ETags are not the MD5 of the bytes


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str = ""  # empty: AWS_ENDPOINT_URL, else AWS's own
    workers: int = 16  # concurrent requests
    chunk_size: int = 8 * 2**20  # multipart threshold and part size
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    max_attempts: int = 5  # botocore's, per request, transient errors only


def parse_s3_uri(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise InputError(f"source {uri}: no bucket name (expected s3://bucket/prefix)")
    return bucket, prefix


class _ProvideListing(BaseSubscriber):
    """Hands s3transfer the size and ETag from the listing: no HeadObject, and ranged GETs pinned to that ETag."""

    def __init__(self, obj: SourceObject, on_bytes: Callable[[int], None]):
        self.obj, self.on_bytes = obj, on_bytes

    def on_queued(self, future, **kwargs) -> None:
        future.meta.provide_transfer_size(self.obj.size)
        future.meta.provide_object_etag(self.obj.etag)

    def on_progress(self, future, bytes_transferred, **kwargs) -> None:
        self.on_bytes(bytes_transferred)


class S3Source:
    def __init__(self, uri: str, settings: S3Settings, what: str = "source"):
        self.uri, self.settings = uri, settings
        self.what = what  # the input it is, in messages: "source", "init_from_model"
        self.bucket, self.prefix = parse_s3_uri(uri)
        config = Config(
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            retries={"mode": "standard", "max_attempts": settings.max_attempts},
            max_pool_connections=2 * settings.workers,
        )
        self.client = boto3.session.Session().client("s3", endpoint_url=settings.endpoint_url or None, config=config)
        self.transfers = TransferManager(
            self.client,
            TransferConfig(
                multipart_threshold=settings.chunk_size,
                multipart_chunksize=settings.chunk_size,
                max_request_concurrency=settings.workers,
            ),
        )

    def close(self) -> None:
        self.transfers.shutdown()

    def fail(self, exc: Exception, doing: str) -> Exception:
        """One line for what went wrong, in the user's terms; unknown errors keep their own message."""
        where = f"{self.what} {self.uri}"
        if isinstance(exc, NoCredentialsError):
            return InputError(
                f"{where}: no AWS credentials found (on EKS: the service account's IAM role; "
                "elsewhere: AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            )
        if isinstance(exc, EndpointConnectionError):
            return StepFailed(f"{where}: cannot reach the S3 endpoint while {doing} ({exc})")
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            message = exc.response.get("Error", {}).get("Message", "") or str(exc)
            if code == "NoSuchBucket":
                return InputError(f"{where}: bucket {self.bucket} does not exist")
            if code in ("AccessDenied", "AllAccessDisabled", "403", "Forbidden"):
                return InputError(
                    f"{where}: access denied while {doing} (check the IAM role's s3:ListBucket "
                    f"and s3:GetObject on this bucket and prefix): {message}"
                )
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
                return InputError(f"{where}: the AWS credentials were refused ({code}: {message})")
            if code in ("PreconditionFailed", "412"):
                return StepFailed(f"{where}: an object changed while it was staged ({doing}); run staging again")
            return StepFailed(f"{where}: S3 error {code or 'unknown'} while {doing}: {message}")
        return StepFailed(f"{where}: {type(exc).__name__} while {doing}: {exc}")

    def list(self) -> list[SourceObject]:
        """Every object under the prefix taken as a directory, or the one object the prefix names exactly."""
        directory = self.prefix if not self.prefix or self.prefix.endswith("/") else self.prefix + "/"
        objects: list[SourceObject] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=directory):
                for item in page.get("Contents", []):
                    key = item["Key"]
                    if key.endswith("/") and item["Size"] == 0:  # a "directory marker": the folder of the console
                        continue
                    relative = key[len(directory) :]
                    objects.append(SourceObject(relative, item["Size"], etag=item.get("ETag", ""), location=key))
            if not objects and self.prefix and not self.prefix.endswith("/"):
                objects = self._single_object()
        except (ClientError, BotoCoreError) as exc:
            raise self.fail(exc, f"listing s3://{self.bucket}/{directory}") from None
        if not objects:
            raise InputError(f"{self.what} {self.uri}: no objects under prefix {directory or '(bucket root)'!r}")
        return objects

    def _single_object(self) -> list[SourceObject]:
        """The object the prefix names, found by a listing (its key sorts first): a HeadObject of a missing key is
        answered 403, not 404, unless the role may list the whole bucket (see list_exact)."""
        item = list_exact(self.client, self.bucket, self.prefix)
        if item is None:
            return []
        name = self.prefix.rsplit("/", 1)[-1]
        return [SourceObject(name, item["Size"], etag=item.get("ETag", ""), location=self.prefix)]

    def fetch(self, obj: SourceObject, out: BinaryIO, on_bytes: Callable[[int], None]) -> str:
        """Download into `out` (empty, opened w+b), verified against the listing's size and ETag; returns the ETag."""
        try:
            if obj.size < self.settings.chunk_size:
                self._get(obj, out, on_bytes)
            else:
                self._ranged_download(obj, out, on_bytes)
        except (ClientError, BotoCoreError) as exc:
            raise self.fail(exc, f"downloading {obj.location}") from None
        return obj.etag

    def _get(self, obj: SourceObject, out: BinaryIO, on_bytes: Callable[[int], None]) -> None:
        for attempt in range(1, STREAM_ATTEMPTS + 1):
            response = self.client.get_object(Bucket=self.bucket, Key=obj.location, IfMatch=obj.etag)
            digest = hashlib.md5(usedforsecurity=False)
            if attempt > 1:
                out.seek(0)
                out.truncate()
            try:
                copied = copy_hashing(response["Body"], out, digest, on_bytes)
                break
            except _STREAM_ERRORS as exc:
                if attempt == STREAM_ATTEMPTS:
                    raise
                log.warning(
                    "s3://%s/%s: the download broke off (%s); attempt %d of %d",
                    self.bucket,
                    obj.location,
                    exc,
                    attempt + 1,
                    STREAM_ATTEMPTS,
                )
            finally:
                response["Body"].close()
        self._verify(obj, copied, digest.hexdigest(), response.get("ServerSideEncryption", ""))

    def _ranged_download(self, obj: SourceObject, out: BinaryIO, on_bytes: Callable[[int], None]) -> None:
        future = self.transfers.download(self.bucket, obj.location, out, subscribers=[_ProvideListing(obj, on_bytes)])
        future.result()
        out.flush()
        size = os.fstat(out.fileno()).st_size
        md5, encryption = None, ""
        if md5_of_etag(obj.etag):  # a large object uploaded in one PUT: its ETag is still checkable, by reading back
            head = self.client.head_object(Bucket=self.bucket, Key=obj.location, IfMatch=obj.etag)
            encryption = head.get("ServerSideEncryption", "")
            digest = hashlib.md5(usedforsecurity=False)
            out.seek(0)
            while chunk := out.read(8 * 2**20):
                digest.update(chunk)
            md5 = digest.hexdigest()
        self._verify(obj, size, md5, encryption)

    def _verify(self, obj: SourceObject, size: int, md5: str | None, encryption: str) -> None:
        if size != obj.size:
            raise StepFailed(
                f"{self.what} {self.uri}: {obj.location} arrived with {size} bytes, listed with {obj.size}"
            )
        expected = md5_of_etag(obj.etag)
        if md5 is not None and expected is not None and encryption not in _KMS and md5 != expected:
            raise StepFailed(f"{self.what} {self.uri}: {obj.location} arrived corrupt (MD5 {md5}, its ETag {obj.etag})")


def list_exact(client: Any, bucket: str, key: str) -> dict[str, Any] | None:
    """The listing entry of the object `key`, or None when there is none.

    Whether an object exists is asked with ListObjectsV2 (Prefix=key, MaxKeys=1), never HeadObject: S3 answers a
    HeadObject or GetObject of a missing key with 404 only when the caller has s3:ListBucket on the bucket, else 403
    (AWS, Amazon S3 API Reference, HeadObject, "Permissions"), and the roles render-iam-policy writes may list only
    their prefixes (an s3:prefix condition, which a HeadObject request does not carry).
    """
    response = client.list_objects_v2(Bucket=bucket, Prefix=key, MaxKeys=1)
    contents = response.get("Contents", [])
    return contents[0] if contents and contents[0]["Key"] == key else None


def upload_directory(directory: Path, uri: str, settings: S3Settings) -> list[str]:
    """Every file under `directory` to s3://bucket/prefix/<relative path> (s3transfer, multipart when large).

    The same client, timeouts and retries as staging; the keys it writes, in order.
    """
    source = S3Source(uri, settings)
    prefix = source.prefix.rstrip("/")
    keys = []
    try:
        futures = []
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            relative = safe_key(path.relative_to(directory).as_posix(), str(directory))
            key = f"{prefix}/{relative}" if prefix else relative
            futures.append(source.transfers.upload(str(path), source.bucket, key))
            keys.append(key)
        for future in futures:
            future.result()
    except (ClientError, BotoCoreError) as exc:
        raise source.fail(exc, f"uploading to {uri}") from None
    finally:
        source.close()
    log.info("uploaded %d files of %s to %s", len(keys), directory, uri)
    return keys

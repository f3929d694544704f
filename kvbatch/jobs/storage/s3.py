"""S3 and S3-compatible servers (MinIO, moto) through boto3.

Credentials, region and endpoint come from the usual AWS sources (AWS_* variables, profiles,
instance roles); boto3 itself reads AWS_ENDPOINT_URL and AWS_ENDPOINT_URL_S3. One client per
process, created on first use: boto3 clients are thread-safe, their creation is not, and a
client must not cross a fork (Celery prefork), so a forked child starts without one.

Writes: small objects are one put_object; bigger ones a multipart upload we drive ourselves
(upload_fileobj cannot pass IfNoneMatch). Conditional writes send IfNoneMatch='*': 412 means
the key exists (first writer wins), 409 a concurrent conflicting write (retry).
"""

from __future__ import annotations

import io
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, NoReturn, cast

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from kvbatch.env_settings import SettingError, env_number
from kvbatch.jobs.storage.base import (
    AlreadyExists,
    Storage,
    StorageError,
    relative_key,
    validate_list_prefix,
)
from kvbatch.redact import redact_urls

log = logging.getLogger(__name__)

MIN_PART_SIZE = 5 * 1024 * 1024  # S3 rejects smaller parts (except the last) at completion
DEFAULT_PART_SIZE = 8 * 1024 * 1024
MAX_PARTS = 10_000
_CONFLICT_RETRIES = 4  # 409 ConditionalRequestConflict: tries of a conditional put
_READ_BUFFER = 1024 * 1024
_PROBE = ".kvbatch-write-check-"  # check_writable's object; list() skips it
# Loose on purpose: legacy buckets and S3-compatible servers allow more than today's AWS rules.
_BUCKET = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")

_client: Any = None
_client_lock = threading.Lock()


def client() -> Any:
    """The process's S3 client, created on first use."""
    global _client
    if _client is None:
        with _client_lock:
            if _client is None:
                config = Config(
                    # Standard mode, set here rather than left to botocore's `legacy`
                    # default: throttling (503 SlowDown, 429) and 5xx/timeouts are retried
                    # with jittered exponential backoff. Past these tries the error reaches
                    # the worker, which retries the shard's step (worker/tasks.py).
                    # total_max_attempts counts the first try, as AWS_MAX_ATTEMPTS does
                    # (Config's max_attempts would count retries only: 5 -> 6 tries).
                    retries={
                        "mode": "standard",
                        "total_max_attempts": _max_attempts(),
                    },
                    # boto3 >= 1.36 adds CRC checksums by default; some S3-compatible servers
                    # reject them.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                try:
                    _client = boto3.session.Session().client("s3", config=config)
                except ValueError as e:  # botocore's own check, or urllib's on a bad bracket
                    endpoint = next((u for u in _endpoints() if u), "")
                    raise StorageError(
                        _without_credentials(
                            f"the S3 endpoint {endpoint!r} (AWS_ENDPOINT_URL) is not a usable "
                            f"URL ({e}): fix it"
                        )
                    ) from None
    return _client


def reset_client() -> None:
    """Forget the client, so the next call builds one from the current environment (tests
    that start a new endpoint; forked children)."""
    global _client, _client_lock
    _client = None
    _client_lock = threading.Lock()


os.register_at_fork(after_in_child=reset_client)


def _setting(name: str, default: int, minimum: int, unit: str) -> int:
    try:
        return int(env_number(name, default, minimum=minimum, unit=unit))
    except SettingError as e:
        raise StorageError(str(e)) from None


def _max_attempts() -> int:
    return _setting("AWS_MAX_ATTEMPTS", 5, 1, "tries")


def _status(e: ClientError) -> int | None:
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


class S3Storage(Storage):
    """`s3://bucket/key`: an object, or (for join/list) the prefix `key/`."""

    def __init__(self, uri: str, part_size: int | None = None):
        if part_size is None:  # KVBATCH_S3_PART_SIZE (bytes) tunes multipart uploads
            part_size = _setting("KVBATCH_S3_PART_SIZE", DEFAULT_PART_SIZE, MIN_PART_SIZE, "bytes")
        _max_attempts()  # checked here, where the caller reports a StorageError, not at first use
        if not uri.startswith("s3://"):
            raise StorageError(f"{uri} is not an s3:// URI")
        bucket, _, key = uri[len("s3://") :].partition("/")
        if not _BUCKET.fullmatch(bucket):
            raise StorageError(f"{uri}: {bucket!r} is not a bucket name: write s3://bucket/key")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size {part_size} is below S3's minimum of {MIN_PART_SIZE}")
        self.uri, self.bucket, self.key, self.part_size = uri, bucket, key, part_size

    # -- reading

    def open_read(self) -> BinaryIO:
        self._require_object("read")
        body = self._call("reading", "get_object", Key=self.key)["Body"]
        return io.BufferedReader(_BodyReader(body, self.uri), _READ_BUFFER)

    def exists(self) -> bool:
        try:
            if self.key:
                self._call("checking", "head_object", Key=self.key)
            else:
                self._call("checking", "head_bucket")
        except _S3Error as e:
            if e.status == 404:
                return False
            raise
        return True

    def check_readable(self) -> None:
        self._require_object("read")
        try:
            self._call("reading", "head_object", Key=self.key)
        except _S3Error as e:
            # HEAD has no error body: a 404 does not say whether the key or the bucket is missing.
            if e.status == 404:
                self._check_bucket("reading")
            raise

    # -- writing

    def check_writable(self) -> None:
        """Put and delete an empty probe object next to the target: only a real put proves the
        bucket exists and the credentials may write there."""
        parent = self.key.rpartition("/")[0]
        probe = f"{parent}/" if parent else ""
        probe += f"{_PROBE}{uuid.uuid4().hex}"
        self._call("writing", "put_object", Key=probe, Body=b"")
        try:
            self._call("cleaning up after a write check of", "delete_object", Key=probe)
        except StorageError as e:  # writable, but we may not delete: say so, go on
            log.warning("left the probe object s3://%s/%s behind: %s", self.bucket, probe, e)

    @contextmanager
    def open_write(self, if_absent: bool = False) -> Iterator[BinaryIO]:
        self._require_object("write")
        upload = _Upload(self, if_absent)
        try:
            yield cast(BinaryIO, upload)
        except BaseException:
            upload.abort()
            raise
        upload.finish()

    def delete(self) -> None:
        self._require_object("delete")
        self._call("deleting", "delete_object", Key=self.key)

    def open_append(self) -> NoReturn:
        raise StorageError(
            f"cannot append to {self.uri}: resume appends to a local output; "
            "write to a local path to resume, or start the job again"
        )

    # -- folders

    def join(self, *parts: str) -> S3Storage:
        base = self.key.rstrip("/")
        key = f"{base}/{relative_key(*parts)}" if base else relative_key(*parts)
        return S3Storage(f"s3://{self.bucket}/{key}", self.part_size)

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_list_prefix(prefix)
        base = self.key.rstrip("/") + "/" if self.key.rstrip("/") else ""
        try:
            paginator = client().get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                for item in page.get("Contents", []):
                    name = item["Key"][len(base) :]
                    if not name.rpartition("/")[2].startswith(_PROBE):
                        yield name
        except (ClientError, BotoCoreError) as e:
            raise self._error(
                e, "listing", "list_objects_v2"
            ) from None  # the cause would print the raw endpoint URL

    # -- helpers

    def _call(self, action: str, op: str, **kwargs: Any) -> Any:
        """client().<op>(Bucket=self.bucket, **kwargs), with errors as _S3Error."""
        try:
            return getattr(client(), op)(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as e:
            raise self._error(
                e, action, op, kwargs.get("Key")
            ) from None  # the cause would print the raw endpoint URL

    def _put_if_absent(self, op: str, **kwargs: Any) -> None:
        """A conditional put/complete: AlreadyExists on 412; 409 retried with backoff.

        If botocore retried a put whose first try landed but whose answer was lost, the retry
        sees our own object and we report AlreadyExists: either way the object is complete."""
        for attempt in range(_CONFLICT_RETRIES):
            try:
                self._call("writing", op, Key=self.key, IfNoneMatch="*", **kwargs)
                return
            except _S3Error as e:
                if e.status == 412:
                    raise AlreadyExists(
                        f"{self.uri} already exists: another writer made it"
                    ) from None
                if e.status != 409 or attempt == _CONFLICT_RETRIES - 1:
                    raise
                if op == "complete_multipart_upload":
                    # AWS: after a 409 on completion the parts must be sent again. The racing
                    # writer has usually won by now; if not, the caller runs the write again.
                    if self.exists():
                        raise AlreadyExists(
                            f"{self.uri} already exists: another writer made it"
                        ) from None
                    raise
                time.sleep(0.05 * 2**attempt)

    def _check_bucket(self, action: str) -> None:
        """Raise the 'bucket does not exist' error if HEAD on the bucket says 404."""
        try:
            self._call(action, "head_bucket")
        except _S3Error as e:
            if e.status == 404:
                raise self._missing_bucket(action) from None

    def _require_object(self, action: str) -> None:
        if not self.key or self.key.endswith("/"):
            raise StorageError(
                f"cannot {action} {self.uri}: it names a bucket or folder, not an object: "
                "add the object's key"
            )

    def _missing_bucket(self, action: str) -> _S3Error:
        return _S3Error(
            f"bucket {self.bucket!r} does not exist ({action} {self.uri}): "
            "create it or fix the URI",
            404,
        )

    def _error(self, e: Exception, action: str, op: str = "", key: str | None = None) -> _S3Error:
        """One clear message per failure kind. Messages never carry credentials."""
        if isinstance(e, ClientError):
            error = e.response.get("Error", {})
            code, status = error.get("Code", ""), _status(e)
            if code == "NoSuchBucket":
                return self._missing_bucket(action)
            if code in ("NoSuchKey", "NotFound") or status == 404:
                return _S3Error(f"{self.uri} not found ({action}): check the URI", 404)
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or (
                status == 403
            ):
                where = f"s3://{self.bucket}/{key}" if key is not None else self.uri
                permission = _PERMISSIONS.get(op, "the S3 permission for this request")
                return _S3Error(
                    f"access denied {action} {where} ({code or status}): the credentials "
                    f"need {permission} on bucket {self.bucket!r}, key {key or self.key!r}; "
                    "check the IAM policy, the bucket policy and any KMS key (S3 answers "
                    "403, not 404, for a missing key if you may not list the bucket)",
                    403,
                )
            detail = error.get("Message") or code
            return _S3Error(f"S3 error {action} {self.uri}: {code} {detail}", status)
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return _S3Error(
                f"no AWS credentials found ({action} {self.uri}): set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run with an instance role",
                None,
            )
        if isinstance(e, (BotoConnectionError, HTTPClientError)):
            return _S3Error(
                f"cannot reach S3 endpoint {client().meta.endpoint_url} ({action} {self.uri}): "
                f"{e}; check AWS_ENDPOINT_URL and the network",
                None,
            )
        return _S3Error(f"S3 error {action} {self.uri}: {e}", None)


# The IAM action each call needs, named in access-denied messages.
_PERMISSIONS = {
    "get_object": "s3:GetObject",
    "head_object": "s3:GetObject",
    "put_object": "s3:PutObject",
    "create_multipart_upload": "s3:PutObject",
    "upload_part": "s3:PutObject",
    "complete_multipart_upload": "s3:PutObject",
    "abort_multipart_upload": "s3:AbortMultipartUpload",
    "delete_object": "s3:DeleteObject",
    "list_objects_v2": "s3:ListBucket",
    "head_bucket": "s3:ListBucket",
}


class _S3Error(StorageError):
    """A StorageError that remembers the HTTP status, so callers can tell 404/409/412 apart."""

    def __init__(self, message: str, status: int | None):
        super().__init__(_without_credentials(message))
        self.status = status


def _endpoints() -> list[str | None]:
    """The S3 endpoints the environment names (boto3 reads them by itself)."""
    return [os.environ.get(name) for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")]


def _without_credentials(message: str) -> str:
    """`message` with the credentials of an endpoint URL (http://user:password@host, which
    botocore repeats in its own errors) masked, as broker URLs are."""
    return redact_urls(message, *_endpoints())


class _BodyReader(io.RawIOBase):
    """get_object's body as a raw stream; io.BufferedReader on top gives lines and reads."""

    def __init__(self, body: Any, uri: str):
        self._body, self._uri = body, uri

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            return self._body.readinto(buffer)
        except BotoCoreError as e:
            raise StorageError(
                _without_credentials(f"reading {self._uri} broke off: {e}; run again")
            ) from None

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


class _Upload(io.BufferedIOBase):
    """The writer open_write yields: buffers up to part_size, then streams parts of a
    multipart upload (started at the first full part). finish() completes it, or sends the
    whole small object with one put; abort() cancels it so no parts linger (they cost money)."""

    def __init__(self, target: S3Storage, if_absent: bool):
        self._target, self._if_absent = target, if_absent
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"write to {self._target.uri} after it was finished")
        data = memoryview(data).cast("B")
        self._buffer += data
        size = self._target.part_size
        while len(self._buffer) >= size:
            self._send_part(bytes(self._buffer[:size]))
            del self._buffer[:size]
        return len(data)

    def finish(self) -> None:
        t = self._target
        try:
            if self._upload_id is None:
                self._put(t, "put_object", Body=bytes(self._buffer))
            else:
                if self._buffer:
                    self._send_part(bytes(self._buffer))
                self._put(
                    t,
                    "complete_multipart_upload",
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )
                self._upload_id = None
        except BaseException:
            self.abort()
            raise
        finally:
            self._buffer = bytearray()
            self.close()

    def abort(self) -> None:
        self.close()
        if self._upload_id is None:
            return
        upload_id, self._upload_id = self._upload_id, None
        t = self._target
        try:
            t._call(
                "aborting the upload to", "abort_multipart_upload", Key=t.key, UploadId=upload_id
            )
        except StorageError as e:  # the original exception matters more; say what is left
            log.warning("multipart upload %s to %s was not aborted: %s", upload_id, t.uri, e)

    def _put(self, t: S3Storage, op: str, **kwargs: Any) -> None:
        if self._if_absent:
            t._put_if_absent(op, **kwargs)
        else:
            t._call("writing", op, Key=t.key, **kwargs)

    def _send_part(self, chunk: bytes) -> None:
        t = self._target
        if len(self._parts) == MAX_PARTS:
            raise StorageError(
                f"{t.uri} needs more than {MAX_PARTS} parts of {t.part_size} bytes: "
                "use a larger part_size"
            )
        if self._upload_id is None:
            started = t._call("starting an upload to", "create_multipart_upload", Key=t.key)
            self._upload_id = started["UploadId"]
        number = len(self._parts) + 1
        etag = t._call(
            "uploading to",
            "upload_part",
            Key=t.key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=chunk,
        )["ETag"]
        self._parts.append({"PartNumber": number, "ETag": etag})

"""One small interface over local paths, '-' (stdin/stdout) and s3:// URIs.

    src = open_storage("s3://bucket/jobs/in.jsonl"); src.check_readable()
    out = open_storage("out/"); out.join(job_id, "output.jsonl").check_writable()
    with src.open_read() as f:
        for line in f: ...                                  # bytes lines, streamed
    with out.join(job_id, "output.jsonl").open_write() as f: ...   # appears whole, or not at all
    out.join(job_id, "shards", "0007.jsonl").write_if_absent(data)  # first writer wins

boto3 is imported only when an s3:// URI is opened.
"""

from __future__ import annotations

import os
import re

from kvbatch.jobs.storage.base import (
    AlreadyExists,
    Storage,
    StorageError,
    relative_key,
    validate_key_part,
)
from kvbatch.jobs.storage.local import LocalStorage
from kvbatch.jobs.storage.stdio import StdioStorage

__all__ = [
    "AlreadyExists",
    "LocalStorage",
    "StdioStorage",
    "Storage",
    "StorageError",
    "absolute_location",
    "is_relative_path",
    "open_storage",
    "relative_key",
    "validate_key_part",
]

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_TYPO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


def open_storage(uri: str) -> Storage:
    """The Storage for `uri`: '-' is stdin/stdout, 's3://bucket/key' is S3 (endpoint, region
    and credentials from the usual AWS variables and config), 'file:///path' or any other
    string is a local path. Other schemes raise StorageError."""
    if not isinstance(uri, str) or not uri:
        raise StorageError("empty storage location: give a path, '-' or an s3:// URI")
    if uri == "-":
        return StdioStorage()
    scheme = _SCHEME.match(uri)
    if scheme is None:
        if _SCHEME_TYPO.match(uri):  # s3:/bucket, s3:bucket: never a local folder named "s3:"
            raise StorageError(
                f"{uri}: not a URI kvbatch reads (s3://bucket/key) nor a plain path; write "
                "./NAME for a local name with a colon"
            )
        return LocalStorage(uri)
    name = scheme.group(1).lower()
    if name == "s3":
        from kvbatch.jobs.storage.s3 import (
            S3Storage,  # boto3 costs ~0.3 s to import: only when used
        )

        return S3Storage(uri)
    if name == "file":
        return LocalStorage(uri[len("file://") :])
    raise StorageError(f"{uri}: unsupported scheme {name}://; use a local path, '-' or s3://")


def _local_path(uri: str) -> str | None:
    """The path of a local location (a plain path or file://), None for '-' and other schemes."""
    if not isinstance(uri, str) or uri in ("", "-"):
        return None
    if uri.startswith("file://"):
        return uri[len("file://") :]
    return None if _SCHEME.match(uri) else uri


def is_relative_path(uri: str) -> bool:
    """True for a local path that depends on the working directory ('out/jobs')."""
    path = _local_path(uri)
    return path is not None and not os.path.isabs(os.path.expanduser(path))


def absolute_location(uri: str) -> str:
    """`uri` with a local path made absolute (from this process's working directory, '~'
    expanded), so that it means the same folder to a process started elsewhere; '-' and
    s3:// unchanged."""
    path = _local_path(uri)
    return uri if path is None else os.path.abspath(os.path.expanduser(path))

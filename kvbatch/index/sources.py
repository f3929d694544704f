"""The documents of a source: a local folder or an S3 prefix, filtered by globs. A document's
id is its key under the source (`guide/tides.md`), the same on every run, so the table can
tell a new document from a changed or a deleted one."""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

from kvbatch.index.report import ErrorRecord
from kvbatch.index.spec import SourceSpec
from kvbatch.jobs.storage.s3 import client as s3_client


class SourceError(Exception):
    """The source cannot be listed at all (a missing folder, an S3 error): the run stops before
    anything is written, since an empty listing would read as every document deleted."""


class DocumentError(Exception):
    """One document cannot be indexed; becomes an ErrorRecord, the run goes on."""

    def __init__(self, stage: str, code: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.code = code

    def record(self, document_id: str) -> ErrorRecord:
        return ErrorRecord(document_id, self.stage, self.code, f"{document_id}: {self}")


@dataclass(frozen=True)
class SourceDocument:
    id: str  # the key under the source, '/'-separated
    uri: str  # where it is read from (a local path or s3://bucket/key)
    size: int  # bytes, from the listing (a too large one is never read)


def list_documents(source: SourceSpec) -> list[SourceDocument]:
    """The source's documents whose keys match an include glob and no exclude glob, sorted by
    id. Symbolic links are not followed (a link could lead out of the source)."""
    if source.uri.startswith("s3://"):
        found = _list_s3(source.uri)
    else:
        found = _list_folder(source.uri)
    return sorted(
        (d for d in found if _matches(d.id, source.include, source.exclude)), key=lambda d: d.id
    )


def _matches(key: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    def hit(patterns):
        return any(fnmatch.fnmatchcase(key, p) for p in patterns)

    return hit(include) and not hit(exclude)


def _list_folder(folder: str) -> list[SourceDocument]:
    root = Path(folder)
    if not root.is_dir():
        raise SourceError(f"source.path: {folder} is not a folder")
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False: links to folders stay
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            key = path.relative_to(root).as_posix()
            docs.append(SourceDocument(key, str(path), path.stat().st_size))
    return docs


def _list_s3(uri: str) -> list[SourceDocument]:
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    docs = []
    try:
        pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", ()):
                key = obj["Key"][len(prefix) :]
                if key and not key.endswith("/"):
                    docs.append(SourceDocument(key, f"s3://{bucket}/{obj['Key']}", obj["Size"]))
    except Exception as e:  # botocore's errors: no bucket, no credentials, no endpoint
        raise SourceError(f"source.path: cannot list {uri}: {e}") from e
    return docs


def read_document(doc: SourceDocument, max_bytes: int) -> bytes:
    """The document's bytes; DocumentError when it is larger than max_bytes (checked before
    reading, and again while reading, in case it grew) or cannot be read."""
    if doc.size > max_bytes:
        raise DocumentError(
            "read",
            "too_large",
            f"{doc.size} bytes, more than source.max_bytes ({max_bytes}); raise it or exclude it",
        )
    try:
        if doc.uri.startswith("s3://"):
            bucket, _, key = doc.uri[len("s3://") :].partition("/")
            body = s3_client().get_object(Bucket=bucket, Key=key)["Body"]
            data = body.read(max_bytes + 1)
        else:
            with open(doc.uri, "rb") as f:
                data = f.read(max_bytes + 1)
    except Exception as e:
        raise DocumentError("read", "unreadable", f"cannot read {doc.uri}: {e}") from e
    if len(data) > max_bytes:
        raise DocumentError("read", "too_large", f"more than source.max_bytes ({max_bytes}) bytes")
    return data

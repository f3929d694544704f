"""'-': stdin for reading, stdout for writing (pipelines: `kvbatch run - -o - < in.jsonl`)."""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO, NoReturn

from kvbatch.jobs.storage.base import Storage, StorageError, refuse_endless_input


class StdioStorage(Storage):
    """stdin/stdout. Nothing here is closed: the process owns both streams. Conditional
    writes, appends, children and listings have no meaning on a pipe and raise StorageError."""

    uri = "-"

    def open_read(self) -> BinaryIO:
        self.check_readable()
        return sys.stdin.buffer

    def exists(self) -> bool:
        return sys.stdin is not None

    def check_readable(self) -> None:
        if sys.stdin is None:
            raise StorageError("input '-' means stdin, but this process has none: pass a path")
        if sys.stdin.isatty():
            raise StorageError(
                "input '-' means stdin, which is a terminal: pipe the job in (... - < job.jsonl)"
            )
        try:
            st = os.fstat(sys.stdin.fileno())
        except (OSError, ValueError, io.UnsupportedOperation):
            return  # a stream without a file (tests, embedding): read as it comes
        refuse_endless_input("input '-' (stdin)", st)

    def check_writable(self) -> None:
        if sys.stdout is None:
            raise StorageError("output '-' means stdout, but this process has none: pass a path")

    @contextmanager
    def open_write(self, if_absent: bool = False) -> Iterator[BinaryIO]:
        if if_absent:
            self._unsupported("a write-once (conditional) output")
        sys.stdout.flush()  # text printed before goes out first
        out = sys.stdout.buffer
        yield out  # not atomic: a pipe cannot take back what was written before an exception
        out.flush()

    def open_append(self) -> NoReturn:
        self._unsupported("resume, which appends to a local output")

    def join(self, *parts: str) -> NoReturn:
        self._unsupported(f"a folder (to hold {'/'.join(parts)!r})")

    def list(self, prefix: str = "") -> NoReturn:
        self._unsupported("listing a folder")

    def _unsupported(self, what: str) -> NoReturn:
        raise StorageError(
            f"'-' (stdin/stdout) cannot be used for {what}: give a path or s3:// URI"
        )

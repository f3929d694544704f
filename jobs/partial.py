"""The answers of a running job, committed in flushed batches so a crash loses no whole line.

While a job runs, each finished request's output line is buffered and written here in batches
(write, flush, fsync). A SIGKILL can tear at most the last line of a batch; `recover()` cuts
that torn tail, and `--resume` then skips every custom_id already here. At the end the lines
are copied to the real output in input order.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path


class PartialOutput:
    def __init__(self, path: Path, flush_lines: int = 64, flush_seconds: float = 2.0) -> None:
        self.path = path
        self.flush_lines, self.flush_seconds = flush_lines, flush_seconds
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self._file = None

    def reset(self) -> None:
        """Start empty (a fresh run)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")

    def recover(self) -> set[str]:
        """custom_ids already committed; a torn last line (no newline) is cut off."""
        if not self.path.exists():
            self.reset()
            return set()
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep != len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)
        return {json.loads(line)["custom_id"] for line in data[:keep].splitlines() if line}

    def add(self, record: dict) -> None:
        self._buffer.append(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        if (
            len(self._buffer) >= self.flush_lines
            or time.monotonic() - self._last_flush >= self.flush_seconds
        ):
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            if self._file is None:
                self._file = open(self.path, "ab")  # noqa: SIM115 - kept open across batches
            self._file.write(b"".join(self._buffer))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._buffer.clear()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def records(self) -> Iterator[tuple[dict, int, int]]:
        """Every committed line, parsed, with its byte offset and length (see `read_at`)."""
        self.close()
        offset = 0
        with open(self.path, "rb") as f:
            for raw in f:
                if raw.strip():
                    yield json.loads(raw), offset, len(raw)
                offset += len(raw)

    def read_at(self, spans: Iterable[tuple[int, int]]) -> Iterator[bytes]:
        """The raw lines at (offset, length) spans, in the order given: the answers are
        reordered by seeking, so finalizing a huge job holds offsets, not lines."""
        with open(self.path, "rb") as f:
            for offset, length in spans:
                f.seek(offset)
                yield f.read(length)

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

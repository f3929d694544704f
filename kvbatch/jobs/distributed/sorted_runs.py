"""An external sort of keyed lines, for finalize: a million answers never in memory at once.

Lines are added in any order with an integer key (a request's position in the job, or an
error's input line). They are buffered up to `run_bytes`, sorted and written to a run file in
a temporary folder; `merged()` then streams every line in key order, a k-way merge (heapq) over
the runs that holds one line per run. Memory: `run_bytes` plus a line per run.

    run file line:  <key, 20 digits> <space> <the line's bytes, newline included>
"""

from __future__ import annotations

import heapq
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

DEFAULT_RUN_BYTES = 32 * 1024 * 1024


class SortedRuns:
    """Add (key, line) pairs in any order; read them back in key order (ties by the bytes)."""

    def __init__(self, folder: str | Path | None = None, run_bytes: int = DEFAULT_RUN_BYTES):
        self._dir = tempfile.TemporaryDirectory(prefix="kvbatch-runs-", dir=folder)
        self._run_bytes = run_bytes
        self._buffer: list[tuple[int, bytes]] = []
        self._buffered = 0
        self._runs: list[Path] = []
        self.count = 0

    def add(self, key: int, line: bytes) -> None:
        if key < 0:
            raise ValueError(f"keys are non-negative, got {key}")
        if not line.endswith(b"\n"):  # one line each: the run files are read by lines
            line += b"\n"
        self._buffer.append((key, line))
        self._buffered += len(line) + 64
        self.count += 1
        if self._buffered >= self._run_bytes:
            self._spill()

    def merged(self) -> Iterator[tuple[int, bytes]]:
        """Every line added, in key order; one pass (the runs are read as files)."""
        if not self._runs:  # it all fits in memory: no file
            self._buffer.sort()
            yield from self._buffer
            return
        self._spill()
        files = [open(path, "rb") for path in self._runs]  # noqa: SIM115 (closed below)
        try:
            yield from heapq.merge(*(_read_run(f) for f in files))
        finally:
            for f in files:
                f.close()

    def close(self) -> None:
        self._buffer = []
        self._dir.cleanup()

    def __enter__(self) -> SortedRuns:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spill(self) -> None:
        if not self._buffer:
            return
        self._buffer.sort()
        path = Path(self._dir.name) / f"run-{len(self._runs):05d}"
        with open(path, "wb", buffering=1 << 20) as f:
            for key, line in self._buffer:
                f.write(b"%020d " % key)
                f.write(line)
        self._runs.append(path)
        self._buffer, self._buffered = [], 0


def _read_run(f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    for raw in f:
        yield int(raw[:20]), raw[21:]

"""An append-only file of records read back by index, so a job of millions of lines keeps on
disk what it would otherwise keep per line in memory.

Records are appended once (the validation pass) and read back (the run pass) with one
positioned read each: the process holds one offset per record (8 bytes), not the records (a
memory map would count every page read against the process's resident memory). The file is
made by mkstemp (O_EXCL, mode 0600) in the job's own private folder and removed on close.
"""

from __future__ import annotations

import os
import tempfile
from array import array
from pathlib import Path


class SpillFile:
    def __init__(self, folder: str | Path | None = None, prefix: str = "kvbatch-spill-") -> None:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".bin", dir=folder)
        self._file = os.fdopen(fd, "wb")
        self.path = Path(name)
        self._offsets = array("q", [0])
        self._reader = None  # opened at the first read: no appends after it

    def append(self, data: bytes | memoryview) -> int:
        """Store one record; returns its index."""
        if self._reader is not None:
            raise RuntimeError("the spill is sealed: no appends after the first read")
        self._file.write(data)
        self._offsets.append(self._offsets[-1] + len(data))
        return len(self._offsets) - 2

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> bytes:
        if self._reader is None:
            self._file.flush()
            self._reader = open(self.path, "rb", buffering=0)  # noqa: SIM115 (closed by close)
        start, end = self._offsets[index], self._offsets[index + 1]
        return os.pread(self._reader.fileno(), end - start, start)

    def close(self) -> None:
        self._file.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.path.unlink(missing_ok=True)

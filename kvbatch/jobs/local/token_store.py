"""Tokenized prompts spilled to a file, so a job of millions of lines keeps memory flat.

Prompts are appended once (validation pass) as int32 and read back by index (run pass) with
one positioned read each: the process holds one offset per prompt, not the tokens (a memory
map would count every page read against the process's resident memory).
"""

from __future__ import annotations

import os
import tempfile
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

INT32 = "i" if array("i").itemsize == 4 else "l"  # the array typecode of a 4-byte int


class TokenStore:
    def __init__(self, folder: str | Path | None = None) -> None:
        fd, name = tempfile.mkstemp(prefix="kvbatch-tokens-", suffix=".bin", dir=folder)
        self._file = os.fdopen(fd, "wb")
        self._path = name
        self._offsets = array("q", [0])
        self._reader = None  # opened at the first read: no appends after it

    def append(self, token_ids: Sequence[int]) -> int:
        """Store one prompt (a list, or an int32 array as a pool's process sends it); returns
        its index."""
        if self._reader is not None:
            raise RuntimeError("the store is sealed: no appends after the first read")
        if not (isinstance(token_ids, array) and token_ids.typecode == INT32):
            token_ids = array(INT32, token_ids)
        self._file.write(token_ids)
        self._offsets.append(self._offsets[-1] + len(token_ids))
        return len(self._offsets) - 2

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> list[int]:
        if self._reader is None:
            self._file.flush()
            self._reader = open(self._path, "rb", buffering=0)  # noqa: SIM115 (closed by close)
        start, end = self._offsets[index], self._offsets[index + 1]
        data = os.pread(self._reader.fileno(), 4 * (end - start), 4 * start)
        return np.frombuffer(data, dtype=np.int32).tolist()

    def close(self) -> None:
        self._file.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        Path(self._path).unlink(missing_ok=True)

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

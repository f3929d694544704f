"""Tokenized prompts spilled to a file, so a job of millions of lines keeps memory flat.

Prompts are appended once (validation pass) as int32 and read back by index (run pass) through
a memory map: the process holds one offset per prompt, not the tokens.
"""

from __future__ import annotations

import os
import tempfile
from array import array
from pathlib import Path

import numpy as np


class TokenStore:
    def __init__(self, folder: str | Path | None = None) -> None:
        fd, name = tempfile.mkstemp(prefix="kvbatch-tokens-", suffix=".bin", dir=folder)
        self._file = os.fdopen(fd, "wb")
        self._path = name
        self._offsets = array("q", [0])
        self._map: np.ndarray | None = None

    def append(self, token_ids: list[int]) -> int:
        """Store one prompt; returns its index."""
        if self._map is not None:
            raise RuntimeError("the store is sealed: no appends after the first read")
        self._file.write(np.asarray(token_ids, dtype=np.int32).tobytes())
        self._offsets.append(self._offsets[-1] + len(token_ids))
        return len(self._offsets) - 2

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> list[int]:
        if self._map is None:
            self._file.flush()
            total = self._offsets[-1]
            self._map = (
                np.memmap(self._path, dtype=np.int32, mode="r", shape=(total,))
                if total
                else np.zeros(0, dtype=np.int32)
            )
        return self._map[self._offsets[index] : self._offsets[index + 1]].tolist()

    def close(self) -> None:
        self._file.close()
        self._map = None
        Path(self._path).unlink(missing_ok=True)

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

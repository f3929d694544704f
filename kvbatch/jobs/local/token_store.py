"""Tokenized prompts spilled to a file, so a job of millions of lines keeps memory flat.

Prompts are appended once (validation pass) as int32 and read back by index (run pass), one
positioned read each (kvbatch.jobs.local.spill): the process holds one offset per prompt, not
the tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvbatch.jobs.local.spill import SpillFile

INT32 = "i" if array("i").itemsize == 4 else "l"  # the array typecode of a 4-byte int


class TokenStore:
    def __init__(self, folder: str | Path | None = None) -> None:
        self.folder = None if folder is None else Path(folder)
        self._spill = SpillFile(folder, prefix="kvbatch-tokens-")

    def append(self, token_ids: Sequence[int]) -> int:
        """Store one prompt (a list, or an int32 array as a pool's process sends it); returns
        its index."""
        if not (isinstance(token_ids, array) and token_ids.typecode == INT32):
            token_ids = array(INT32, token_ids)
        return self._spill.append(memoryview(token_ids).cast("B"))

    def __len__(self) -> int:
        return len(self._spill)

    def __getitem__(self, index: int) -> list[int]:
        return np.frombuffer(self._spill[index], dtype=np.int32).tolist()

    def close(self) -> None:
        self._spill.close()

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

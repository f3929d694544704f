"""Every live sequence's block table mirrored in one zero-padded numpy array.

The runner needs a step's block tables as one [num_seqs, max_blocks] array. Built from the KV
manager's Python lists, that is a pass over every entry of every table each step (~40k ints at
512 running sequences); mirrored here as blocks are appended, it is one gather:

    array   row 0: 0 0 0 0 ...        always zero (unknown sequences read it)
            row 1: 7 2 9 5 0 0 ...    seq A's table, zero past its length
            row 2: 7 2 4 0 0 0 ...    seq C's
    step tables = array[[1, 2], :4]

Rows are reused after a sequence is freed; the array grows (doubling) in rows and width.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TableRows:
    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.array = np.zeros((max(rows, 2), max(width, 1)), dtype=np.int64)
        self._free = list(range(self.array.shape[0] - 1, 0, -1))  # row 0 stays zero

    def acquire(self) -> int:
        """A zeroed row for a new sequence."""
        if not self._free:
            old = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def release(self, row: int, length: int) -> None:
        """The sequence is gone: zero its `length` entries and reuse the row."""
        self.array[row, :length] = 0
        self._free.append(row)

    def write(self, row: int, start: int, blocks: Sequence[int]) -> None:
        """Entries start .. start + len(blocks) - 1 of the row become `blocks`."""
        end = start + len(blocks)
        if end > self.array.shape[1]:
            width = max(end, 2 * self.array.shape[1])
            grown = np.zeros((self.array.shape[0], width), dtype=np.int64)
            grown[:, : self.array.shape[1]] = self.array
            self.array = grown
        self.array[row, start:end] = blocks

    def clear(self, row: int, start: int, end: int) -> None:
        """Entries start .. end - 1 of the row are no longer in the table (truncation)."""
        self.array[row, start:end] = 0

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """[len(rows), width] copy of those rows (width <= the widest table written)."""
        return self.array[rows, :width]

    @property
    def free_rows(self) -> list[int]:
        return list(self._free)

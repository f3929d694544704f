"""Every live sequence's block table mirrored in one zero-padded numpy array.

The runner needs a step's block tables as one [num_seqs, max_blocks] array. Built from the KV
manager's Python lists, that is a pass over every entry of every table each step (~40k ints at
512 running sequences); mirrored here as blocks are appended, it is one gather (from the
device's copy of this array, below):

    array   row 0: 0 0 0 0 ...        always zero (unknown sequences read it)
            row 1: 7 2 9 5 0 0 ...    seq A's table, zero past its length
            row 2: 7 2 4 0 0 0 ...    seq C's
    step tables = array[[1, 2], :4]

Rows are reused after a sequence is freed; the array grows (doubling) in rows and width.

Every entry written or zeroed is also logged, so that a copy of the array kept on the device
(engine/kv/device_tables.py) can follow it with the few entries that changed each step instead
of taking whole tables: a 32k context's row is 2,049 entries, and copying it every step of
its decoding (with 64 short rows padded to its width, ~1 MB) costs milliseconds of host time
per step. Growth needs no entry: new rows and columns are zero in both copies.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np


class TableChanges(NamedTuple):
    """Entries of the array that changed since the last `take_changes`, with their values now."""

    rows: np.ndarray  # [n] int64
    cols: np.ndarray  # [n] int64
    values: np.ndarray  # [n] int64
    shape: tuple[int, int]  # the array's shape now (a copy must be at least this large)


class TableRows:
    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.array = np.zeros((max(rows, 2), max(width, 1)), dtype=np.int64)
        self._free = list(range(self.array.shape[0] - 1, 0, -1))  # row 0 stays zero
        self._changed: list[tuple[int, int, int]] = []  # (row, start, end) since take_changes

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
        self._changed.append((row, 0, length))
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
        self._changed.append((row, start, end))

    def clear(self, row: int, start: int, end: int) -> None:
        """Entries start .. end - 1 of the row are no longer in the table (truncation)."""
        self.array[row, start:end] = 0
        self._changed.append((row, start, end))

    def take_changes(self) -> TableChanges:
        """The entries written or zeroed since the last call, with their current values (an
        entry changed twice appears twice, with the same value). One reader: the runner."""
        spans = np.array(self._changed, dtype=np.int64).reshape(-1, 3)
        self._changed = []
        rows, starts, ends = spans.T
        lens = ends - starts
        offsets = np.cumsum(lens) - lens  # where each span starts in the flat list
        cols = np.arange(int(lens.sum())) + np.repeat(starts - offsets, lens)
        rows = np.repeat(rows, lens)
        return TableChanges(rows, cols, self.array[rows, cols], self.array.shape)

    @property
    def free_rows(self) -> list[int]:
        return list(self._free)


class TableRefs(NamedTuple):
    """Where several sequences' tables are in a manager's `table_array`."""

    rows: np.ndarray  # [num_seqs] int64 (0: an empty row)
    num_blocks: np.ndarray  # [num_seqs] int64: each table's length


class MirroredTables:
    """What the runner reads of a KV manager's tables (engine/kv/kv_cache.py's, and each
    window group's, engine/kv/window_group.py): `_seqs` maps a sequence to a state with its
    `row` here and its `table`, and `_rows` mirrors the tables."""

    _seqs: dict
    _rows: TableRows

    def table_rows(self, seq_ids: Sequence[Hashable]) -> TableRefs:
        """Where `seq_ids`' tables are in `table_array` (row 0, always zero, for unknown ids)
        and their lengths. The runner's per-step path: it reads only the entries it needs on
        the host, and gathers the step's tables from its copy on the device."""
        states = [self._seqs.get(s) for s in seq_ids]
        rows = np.fromiter((st.row if st else 0 for st in states), np.int64, len(states))
        lens = np.fromiter((len(st.table) if st else 0 for st in states), np.int64, len(states))
        return TableRefs(rows, lens)

    @property
    def table_array(self) -> np.ndarray:
        """Every table as a zero-padded row; read only."""
        return self._rows.array

    def take_table_changes(self) -> TableChanges:
        """The entries of `table_array` changed since the last call (one reader: the runner,
        which keeps a copy on the device, engine/kv/device_tables.py)."""
        return self._rows.take_changes()

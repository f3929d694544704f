"""The KV manager's block tables, kept on the device and updated by the entries that changed.

A step needs its sequences' tables on the device: the decodes' (for their attention, in one
[rows, width] tensor) and the prompt chunks'. Gathered on the host and copied each step, that
is the width of the longest context for every row: once a 32k prompt decodes beside 64 short
ones, 65 x 2,049 entries (~1 MB) gathered, packed, pinned and copied per step, for a table in
which only a few entries changed (a decode adds a block every 16 tokens). The host's step
preparation then grows several times over a plain step's, and the decoders' token gaps
follow it.

So the tables live on the device as a copy of the host's mirror (engine/kv/table_rows.py), and
each step sends only the entries that changed and the step's row numbers; the step's tables
are then gathered on the device (vLLM v1 keeps a persistent block table on the GPU likewise):

    host   TableRows.array            changes since the last step: (row 2, col 7) = 93
    device DeviceBlockTables.array    array[2, 7] = 93, then  tables = array[[2, 5, 1], :w]

Everything is queued on one stream, so a step's gathers see exactly the changes made before
it was prepared, and steps already queued have their own gathered copies. The decodes'
tables are laid out on the host (plan_decode_tables: shared-prefix groups, widths) and
gathered on the device (gather_decode_tables).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class DeviceBlockTables:
    def __init__(self, device: torch.device) -> None:
        self.array = torch.zeros((1, 1), dtype=torch.int64, device=device)
        self.empty = self.array[:0, :0]  # [0, 0]: no tables (read only)

    def apply(
        self,
        shape: tuple[int, int],
        rows: torch.Tensor,
        cols: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        """Take the host's changes (engine/kv/table_rows.py TableChanges: the host array's shape,
        and its rows, cols and values already on the device)."""
        have_rows, have_width = self.array.shape
        if shape[0] > have_rows or shape[1] > have_width:  # the host's array grew: zeros
            grown = self.array.new_zeros((max(shape[0], have_rows), max(shape[1], have_width)))
            grown[:have_rows, :have_width] = self.array
            self.array = grown
        if rows.numel():
            self.array[rows, cols] = values

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width] tables, zero past each row's length (and for row 0); a copy, so
        changes applied for later steps leave it as it is."""
        return self.array[rows, :width]

    def gather_after(
        self,
        rows: torch.Tensor,
        num_blocks: torch.Tensor,
        width: int,
        skip: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[len(rows), width]: each row's blocks from column skip[i] on (0 without skip), zero
        from column num_blocks[i] on: the private part of a row whose first skip[i] blocks are
        shared, or (no skip, num_blocks the shared count) a group's shared blocks."""
        cols = torch.arange(width, device=rows.device)[None, :]  # [1 or rows, width]
        if skip is not None:
            cols = skip[:, None] + cols
        out = self.array[rows[:, None], cols.clamp(max=self.array.shape[1] - 1)]
        return out.masked_fill_(cols >= num_blocks[:, None], 0)


class DecodeTablePlan(NamedTuple):
    """How the decodes' tables are laid out (host side; the tables are on the device). With
    shared-prefix groups, each row keeps only its blocks after its group's shared ones, and
    each group's shared blocks appear once:

        row tables   [S S S a1 a2]   [S S S b1]      groups' tables  [S S S]
        private      [a1 a2]         [b1 0]          (one row per group)
    """

    skip: np.ndarray  # [D] shared blocks before each row's own (0 outside groups)
    lens: np.ndarray  # [D] private context tokens
    width: int  # private tables' width: the longest private part
    group_rows: np.ndarray  # [G] the table row of each group's first member
    group_blocks: np.ndarray  # [G] each group's shared blocks
    group_ranges: np.ndarray  # [3, G] first decode row, rows, shared tokens

    @property
    def group_width(self) -> int:
        return int(self.group_blocks.max(initial=0))

    def arrays(self) -> list[np.ndarray]:
        """What travels to the device, as gather_decode_tables takes them (from skip on)."""
        return [self.skip, self.lens, self.group_rows, self.group_blocks, self.group_ranges]


def plan_decode_tables(rows, num_blocks, context_lens, groups, block_size) -> DecodeTablePlan:
    """The layout of the decodes' tables (rows: theirs in the KV manager's table array).
    Without groups the tables are cut to the decodes' own width: a prompt chunk in the step
    may be far longer, and the decode kernel splits contexts by the table's width."""
    skip = np.zeros(len(rows), dtype=np.int64)
    for start, end, shared in groups:
        skip[start:end] = shared
    width = int((num_blocks - skip).max(initial=0))
    firsts = np.array([start for start, _, _ in groups], np.int64)
    group_blocks = np.array([shared for _, _, shared in groups], np.int64)
    ranges = np.array([(s, e - s, n * block_size) for s, e, n in groups], np.int64).reshape(-1, 3)
    return DecodeTablePlan(
        skip,
        context_lens - skip * block_size,
        width,
        rows[firsts],
        group_blocks,
        ranges.T.copy(),
    )


def gather_decode_tables(
    tables: DeviceBlockTables,
    plan: DecodeTablePlan,
    rows: torch.Tensor,  # [D] the decodes' rows in the table array
    num_blocks: torch.Tensor,  # [D] their tables' lengths
    skip: torch.Tensor,  # the rest: plan.arrays() on the device
    lens: torch.Tensor,
    group_rows: torch.Tensor,
    group_blocks: torch.Tensor,
    group_ranges: torch.Tensor,
):
    """The decodes' tables on the device, laid out as `plan` says: (private tables [D, P],
    private lengths [D], group tables [G, max shared], group ranges [3, G])."""
    if not len(plan.group_blocks):  # most steps: no torch op more than needed
        return tables.gather(rows, plan.width), lens, tables.empty, group_ranges
    private = tables.gather_after(rows, num_blocks, plan.width, skip)
    group_tables = tables.gather_after(group_rows, group_blocks, plan.group_width)
    return private, lens, group_tables, group_ranges

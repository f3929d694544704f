"""The runner's step tables: laid out on the host, gathered on the device
(engine/device_tables.py)."""

from __future__ import annotations

import numpy as np
import torch

from kvbatch.engine.kv.device_tables import (
    DeviceBlockTables,
    gather_decode_tables,
    plan_decode_tables,
)
from kvbatch.engine.kv.table_rows import TableRows


def table_rows(num_blocks: list[int], width: int, rng: np.random.Generator):
    """A TableRows holding random tables of those lengths (one row each, with the array
    `width` wide), its device copy, and the rows."""
    host = TableRows(rows=2, width=width)
    rows = np.array([host.acquire() for _ in num_blocks])
    for row, n in zip(rows, num_blocks):
        host.write(int(row), 0, rng.integers(1, 10_000, n).tolist())
    device = DeviceBlockTables(torch.device("cpu"))
    apply(device, host)
    return host, device, rows


def apply(device: DeviceBlockTables, host: TableRows) -> None:
    changes = host.take_changes()
    device.apply(changes.shape, *(torch.from_numpy(a) for a in changes[:3]))


def decode_tables(device, rows, num_blocks, context_lens, groups, block_size=16):
    plan = plan_decode_tables(rows, num_blocks, context_lens, groups, block_size)
    arrays = [torch.from_numpy(a) for a in (rows, num_blocks, *plan.arrays())]
    return [t.numpy() for t in gather_decode_tables(device, plan, *arrays)]


def test_without_groups_the_tables_are_the_decodes_own_width():
    """A prompt chunk in the step may be far longer than the decodes; the decode kernel cuts
    contexts into splits by the table's width, so the decodes' tables must be cut back to
    their own longest row, with every row's blocks and nothing past them."""
    rng = np.random.default_rng(0)
    num_blocks = np.array([3, 9, 1, 2049, 5])  # one long context decoding beside short ones
    host, device, rows = table_rows(num_blocks.tolist() + [4096], 4096, rng)
    rows = rows[:5]  # (the last table, a prompt's, is not in the decodes)
    context_lens = num_blocks * 16 - 7
    private, lens, group_tables, ranges = decode_tables(device, rows, num_blocks, context_lens, [])
    assert private.shape == (5, 2049)
    for i, (row, n) in enumerate(zip(rows, num_blocks)):
        assert private[i, :n].tolist() == host.array[row, :n].tolist()
        assert not private[i, n:].any()
    assert lens.tolist() == context_lens.tolist()
    assert group_tables.shape == (0, 0) and ranges.shape == (3, 0)


def test_with_a_group_each_row_keeps_its_blocks_after_the_shared_ones():
    rng = np.random.default_rng(1)
    num_blocks = np.array([6, 4, 2049, 7])
    host, device, rows = table_rows(num_blocks.tolist(), 64, rng)
    host.write(int(rows[1]), 0, host.array[rows[0], :3].tolist())  # rows 0, 1 share 3 blocks
    apply(device, host)
    context_lens = num_blocks * 16 - 2
    groups = [(0, 2, 3)]
    private, lens, group_tables, ranges = decode_tables(
        device, rows, num_blocks, context_lens, groups
    )
    skip = [3, 3, 0, 0]
    assert private.shape == (4, 2049)
    for i, (row, n) in enumerate(zip(rows, num_blocks)):
        assert private[i, : n - skip[i]].tolist() == host.array[row, skip[i] : n].tolist()
        assert not private[i, n - skip[i] :].any()
    assert lens.tolist() == (context_lens - np.array(skip) * 16).tolist()
    assert group_tables.tolist() == [host.array[rows[0], :3].tolist()]
    assert ranges.tolist() == [[0], [2], [48]]


def test_a_private_part_reaching_past_the_array_is_zero_there():
    """A row whose shared blocks come first is read from column `skip` on, as wide as the
    longest private part: past the array's width the gather is clamped, and must give 0."""
    rng = np.random.default_rng(2)
    num_blocks = np.array([8, 8, 6])
    host, device, rows = table_rows(num_blocks.tolist(), 8, rng)
    host.write(int(rows[1]), 0, host.array[rows[0], :5].tolist())
    apply(device, host)
    assert device.array.shape[1] == 8
    private, *_ = decode_tables(device, rows, num_blocks, num_blocks * 16, [(0, 2, 5)])
    assert private.shape == (3, 6)  # row 2's private part: all of its 6 blocks
    assert private[0].tolist() == host.array[rows[0], 5:8].tolist() + [0, 0, 0]
    assert private[2].tolist() == host.array[rows[2], :6].tolist()

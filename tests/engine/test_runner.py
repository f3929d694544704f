"""The runner's host-side step tables (engine/runner.py)."""

from __future__ import annotations

import numpy as np

from engine.runner import _decode_tables


def zero_padded(num_blocks: list[int], width: int, rng: np.random.Generator) -> np.ndarray:
    tables = np.zeros((len(num_blocks), width), np.int64)
    for row, n in enumerate(num_blocks):
        tables[row, :n] = rng.integers(1, 10_000, n)
    return tables


def test_without_groups_the_tables_are_the_decodes_own_width():
    """A prompt chunk in the step widens the gathered tables to its context; the decode
    kernel cuts contexts into splits by the table's width, so the decodes' tables must be cut
    back to their own longest row, with every row's blocks and nothing past them."""
    rng = np.random.default_rng(0)
    num_blocks = np.array([3, 9, 1, 2049, 5])  # one long context decoding beside short ones
    tables = zero_padded(num_blocks.tolist(), 4096, rng)
    context_lens = num_blocks * 16 - 7
    private, lens, group_tables, ranges = _decode_tables(tables, num_blocks, context_lens, [], 16)
    assert private.shape == (5, 2049)
    for row, n in enumerate(num_blocks):
        assert private[row, :n].tolist() == tables[row, :n].tolist()
        assert not private[row, n:].any()
    assert lens.tolist() == context_lens.tolist()
    assert group_tables.shape == (0, 0) and ranges.shape == (3, 0)


def test_with_a_group_each_row_keeps_its_blocks_after_the_shared_ones():
    rng = np.random.default_rng(1)
    num_blocks = np.array([6, 4, 2049, 7])
    tables = zero_padded(num_blocks.tolist(), 2049, rng)
    tables[1, :3] = tables[0, :3]  # rows 0 and 1 share three blocks
    context_lens = num_blocks * 16 - 2
    groups = [(0, 2, 3)]
    private, lens, group_tables, ranges = _decode_tables(
        tables, num_blocks, context_lens, groups, 16
    )
    skip = [3, 3, 0, 0]
    assert private.shape == (4, 2049)
    for row, n in enumerate(num_blocks):
        assert private[row, : n - skip[row]].tolist() == tables[row, skip[row] : n].tolist()
        assert not private[row, n - skip[row] :].any()
    assert lens.tolist() == (context_lens - np.array(skip) * 16).tolist()
    assert group_tables.tolist() == [tables[0, :3].tolist()]
    assert ranges.tolist() == [[0], [2], [48]]

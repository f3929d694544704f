"""What a decode step's attention works out once for all its layers (torch backend).

Every layer of a step reads the same rows, groups, tables and lengths; only its K and V
differ. Which long rows read their context as a group of one, how the private parts split
into length octaves, the blocks the step writes and the kept prefixes' keys are therefore the
same in every layer. Worked out per layer (a few dozen small tensor ops and host copies each),
they cost a mixed batch (a row with no group beside a document's group) about three times
what they cost a batch of one group, thirty times a step; the backend keeps one plan per
step's metadata and window size instead (`TorchAttentionBackend._plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbatch.engine.attention.decode_rows import length_buckets, window_tail

# A row with no group whose own context is at least this long (a document's last chunk
# decoding alone) reads its full blocks as a "group of one" through the kept prefixes: they do
# not change from step to step either, and gathering them is most of such a row's cost.
SOLO_PREFIX_MIN_TOKENS = 512


@dataclass
class DecodeGroup:
    """Decode rows [start, end) share the blocks `block_ids` at the start of their contexts."""

    start: int
    end: int
    block_ids: torch.Tensor  # [num_shared_blocks] int64


@dataclass
class DecodePlan:
    """A step's decode rows as one layer kind (full, or one window size) reads them."""

    groups: list[DecodeGroup]  # shared prefixes, groups of one for long ungrouped rows included
    tables: torch.Tensor  # [B, P] each row's own blocks (a windowed layer's: inside its window)
    lens: torch.Tensor  # [B] keys in those blocks, the newest token's included
    buckets: list[tuple[torch.Tensor, int]] | None  # (rows, blocks read) per length octave
    prefix_keys: list[tuple[int, ...]]  # each group's block ids: its kept prefix's key
    written_blocks: frozenset[int]  # blocks the step writes: kept prefixes over them are stale


def plan_decode(
    tables: torch.Tensor,  # [B, P] blocks after each row's shared prefix (all, without groups)
    lens: torch.Tensor,  # [B]
    groups: list[DecodeGroup],
    written_slots: torch.Tensor | None,  # [T] the step's writes (negative: none); None: unknown
    block_size: int,
    sliding_window: int | None = None,
    solo: bool = False,  # long ungrouped rows become groups of one (full-attention layers)
) -> DecodePlan:
    """The rows' groups, own blocks and length octaves for one layer kind."""
    if solo and sliding_window is None:
        groups, tables, lens = with_solo_prefixes(groups, tables, lens, block_size)
    if sliding_window is not None:  # read only the blocks inside the window
        tables, lens = window_tail(tables, lens, sliding_window, block_size)
    buckets = length_buckets(lens)
    if buckets is not None:
        buckets = [(rows, -(-int(lens[rows].max()) // block_size)) for rows in buckets]
    written: frozenset[int] = frozenset()
    if groups and written_slots is not None:
        slots = written_slots[written_slots >= 0]
        written = frozenset(torch.unique(slots // block_size).tolist())
    keys = [tuple(grp.block_ids.tolist()) for grp in groups]
    return DecodePlan(groups, tables, lens, buckets, keys, written)


def with_solo_prefixes(
    groups: list[DecodeGroup],
    private_tables: torch.Tensor,  # [B, P]
    private_lens: torch.Tensor,  # [B]
    block_size: int,
) -> tuple[list[DecodeGroup], torch.Tensor, torch.Tensor]:
    """The groups, plus a group of one for each long row outside them (its full blocks before
    the one holding its newest token), and the private tables and lengths cut after them."""
    lens = private_lens.tolist()
    grouped = [False] * len(lens)
    for grp in groups:
        grouped[grp.start : grp.end] = [True] * (grp.end - grp.start)
    skip = [
        (n - 1) // block_size if not g and n >= SOLO_PREFIX_MIN_TOKENS else 0
        for n, g in zip(lens, grouped)
    ]
    if not any(skip):
        return groups, private_tables, private_lens
    solo = [DecodeGroup(row, row + 1, private_tables[row, :k]) for row, k in enumerate(skip) if k]
    skip_t = torch.tensor(skip, device=private_lens.device)
    width = max(-(-n // block_size) - k for n, k in zip(lens, skip))
    columns = (skip_t[:, None] + torch.arange(width, device=skip_t.device)).clamp_max(
        private_tables.shape[1] - 1
    )  # past a row's last block: masked, beyond its length
    return groups + solo, private_tables.gather(1, columns), private_lens - skip_t * block_size

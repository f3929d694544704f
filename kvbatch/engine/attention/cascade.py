"""Shared-prefix ("cascade") attention for decode steps.

When several decoding sequences share the same physical prefix blocks (the prefix cache gave
them the same document, system prompt or tool list), plain paged attention reads those blocks
once per sequence. Cascade attention splits each sequence's context in two:

    seq a: [ shared blocks S | a's own blocks ]     attention(q_a, S ∪ A)
    seq b: [ shared blocks S | b's own blocks ]       = merge(attention(q_a, S), attention(q_a, A))

The shared part is computed for the whole group at once (all its queries against S in one
matmul, so S is read once per group), the private part per sequence, and the two partial
results are merged exactly with their log-sum-exps:

    lse = logaddexp(lse_S, lse_A);  out = out_S * exp(lse_S - lse) + out_A * exp(lse_A - lse)

This is the two-level form of FlashInfer's cascade / Hydragen's shared-prefix attention.
An FP8 cache's blocks are dequantized as they are gathered (kernels/kv_quant.py). The private
parts are batched by length (engine/attention/decode_rows.py), never padded to the longest
row, and a group's gathered prefix is kept across steps (engine/attention/prefix_memo.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbatch.engine.attention.decode_rows import (
    attention_with_lse,
    join_sinks,
    merge_partial,
    rows_attention,
)
from kvbatch.engine.attention.kv_scales import UNIT_KV_SCALES, KVScales
from kvbatch.engine.attention.kv_view import KVView
from kvbatch.engine.attention.layer_spec import FULL_ATTENTION, LayerAttention
from kvbatch.engine.attention.prefix_memo import GatheredPrefixes


@dataclass
class DecodeGroup:
    """Decode rows [start, end) share the blocks `block_ids` at the start of their contexts."""

    start: int
    end: int
    block_ids: torch.Tensor  # [num_shared_blocks] int64


def find_shared_prefixes(
    tables: np.ndarray,  # [R, W] block tables, zero-padded (KVCacheManager.table_array)
    context_lens: np.ndarray,  # [B] tokens per row, including the new one
    block_size: int,
    min_group: int = 2,
    rows: np.ndarray | None = None,  # [B] the rows of `tables` to group (default: all)
) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """Order decode rows so sharers are adjacent and find each group's shared block count.

    Returns (row order, [(start, end, num_shared_blocks)] in that order); with `rows`, the
    order indexes `rows` (the runner passes the KV manager's whole table array and the
    step's rows in it, so that no column past a group's is ever gathered). Rows are grouped
    by their first physical block; a group's shared prefix is the longest common run of block
    ids, capped so that every member keeps at least its newest token private. Vectorised over
    all rows at once: this runs every decode step.

    Only the columns a group could share are compared: up to the largest cap of a group of
    `min_group` or more. One long row (a 32k prompt decoding: 2,048 blocks) widens the step's
    tables, but alone in its group it adds no columns (comparing them all would double this
    function's time, and it runs on the host every decode step).
    """
    rows = np.arange(len(tables)) if rows is None else rows
    n = len(rows)
    order = np.argsort(tables[rows, 0], kind="stable")
    first = tables[rows[order], 0]
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1]])  # each group's first row
    sizes = np.diff(np.r_[starts, n])
    # every member keeps its newest token private
    caps = np.minimum.reduceat((context_lens[order] - 1) // block_size, starts)
    candidates = (sizes >= min_group) & (caps > 0)
    if not candidates.any():
        return order, []
    width = int(caps[candidates].max())
    ordered = tables[rows[order], :width]
    # A group's common prefix is the shortest run any member shares with the group's first.
    same = ordered == ordered[np.repeat(starts, sizes)]  # [n, width]
    run = np.where(same.all(axis=1), width, same.argmin(axis=1))
    shared = np.minimum(np.minimum.reduceat(run, starts), caps)
    keep = candidates & (shared > 0)
    groups = [
        (s, s + size, k)
        for s, size, k in zip(starts[keep].tolist(), sizes[keep].tolist(), shared[keep].tolist())
    ]
    return order, groups


def cascade_decode(
    q: torch.Tensor,  # [B, heads, head_dim], rows ordered so each group is contiguous
    kv_cache: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim]
    private_tables: torch.Tensor,  # [B, P] blocks after each row's shared prefix
    private_lens: torch.Tensor,  # [B] tokens in those blocks (>= 1)
    groups: list[DecodeGroup],
    scales: KVScales = UNIT_KV_SCALES,  # an FP8 cache's (ignored by a float cache)
    layer: LayerAttention = FULL_ATTENTION,
    sinks: torch.Tensor | None = None,  # [heads] float32: gpt-oss's per-head sink logits
    prefixes: GatheredPrefixes | None = None,  # shared prefixes kept from earlier steps
    written_slots: torch.Tensor | None = None,  # [T] this step's writes (with `prefixes`)
) -> torch.Tensor:  # [B, heads, head_dim]
    """Decode attention by parts: each row against its own blocks (rows_attention: batched by
    length octave, so a row with no group, holding a whole document, pads no other row), each
    group's queries against its shared prefix at once, read once per group (and, with
    `prefixes`, gathered once for as many steps as its blocks stay unwritten), then the sinks.

    A sliding window may end inside a group's shared prefix: the shared part is then masked
    per row (each row's query sits at its own position), still read once per group; rows whose
    window has left the prefix entirely take nothing from it."""
    num_seqs, num_heads, head_dim = q.shape
    view = KVView(kv_cache, scales, q.dtype)
    num_kv_heads, block_size = view.num_kv_heads, view.block_size
    g = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, g, head_dim)

    # Row b's query sits at private position private_lens[b] - 1 (after its shared prefix).
    out, lse = rows_attention(qg, view, private_tables, private_lens, layer)

    if prefixes is not None and written_slots is not None:
        shared = prefixes.read(view, [grp.block_ids for grp in groups], written_slots)
    else:
        shared = [_prefix(view, grp.block_ids) for grp in groups]
    for grp, (keys, values) in zip(groups, shared):  # [1, kvh, S, d] each
        n = grp.end - grp.start
        # [n, kvh, g, d] -> [1, kvh, n * g, d]: the group's queries become one batch
        qs = qg[grp.start : grp.end].transpose(0, 1).reshape(1, num_kv_heads, n * g, head_dim)
        shared_mask = None
        if layer.sliding_window is not None:
            shared_len = grp.block_ids.numel() * block_size
            q_pos = shared_len + private_lens[grp.start : grp.end] - 1  # [n]
            k_pos = torch.arange(shared_len, device=q.device)
            rows_mask = layer.visible(q_pos, k_pos)  # [n, S]
            # the group's queries in qs's order: [n * g] rows, each row's g heads together
            shared_mask = rows_mask.repeat_interleave(g, dim=0)[None, None]  # [1, 1, n*g, S]
        out_s, lse_s = attention_with_lse(qs, keys, values, shared_mask, layer)
        out_s = out_s.view(num_kv_heads, n, g, head_dim).transpose(0, 1)
        lse_s = lse_s.view(num_kv_heads, n, g).transpose(0, 1)
        rows = slice(grp.start, grp.end)
        out[rows], lse[rows] = merge_partial(out[rows], lse[rows], out_s, lse_s)
    if sinks is not None:
        out = join_sinks(out, lse, sinks)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefix(view: KVView, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared prefix's K and V as [1, kv_heads, S, head_dim], gathered now."""
    keys, values = view.gather(block_ids)
    return keys.transpose(0, 1)[None], values.transpose(0, 1)[None]

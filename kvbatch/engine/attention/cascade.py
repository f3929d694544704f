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
An FP8 cache's blocks are dequantized as they are gathered (kernels/kv_quant.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbatch.engine.attention.kv_scales import UNIT_KV_SCALES, KVScales
from kvbatch.engine.attention.layer_spec import (
    FULL_ATTENTION,
    LayerAttention,
    join_sink,
    soft_capped_scores,
)
from kvbatch.kernels.kv_quant import dequantize_kv, is_fp8


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


def attention_with_lse(
    q: torch.Tensor,  # [B, kv_heads, q_per_kv, head_dim]
    k: torch.Tensor,  # [B, kv_heads, S, head_dim]
    v: torch.Tensor,  # [B, kv_heads, S, head_dim]
    valid: torch.Tensor | None,  # [B, S] or [B, 1, q_per_kv, S] bool; None: every key valid
    layer: LayerAttention = FULL_ATTENTION,
    sinks: torch.Tensor | None = None,  # [kvh, g] joined to this part's denominator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns log-sum-exp: ([B, kvh, g, d], [B, kvh, g]).
    A row with no valid key (a window that ends before a shared prefix does) gets output 0
    and log-sum-exp -inf, so that merging it adds nothing. `sinks` (the layer's, passed for
    exactly one of the parts that are merged) join the denominator and the lse."""
    scores = soft_capped_scores(q, k, layer)  # [B, kvh, g, S]
    if valid is not None:
        valid = valid[:, None, None, :] if valid.dim() == 2 else valid
        scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, kvh, g]
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(lse.dtype).min)[..., None])
    out = torch.matmul(probs, v)
    if sinks is not None:
        out, lse = join_sink(out, lse, sinks)
    return out, lse


def cascade_decode(
    q: torch.Tensor,  # [B, heads, head_dim], rows ordered so each group is contiguous
    kv_cache: torch.Tensor,  # [2, blocks, block_size, kv_heads, head_dim]
    private_tables: torch.Tensor,  # [B, P] blocks after each row's shared prefix
    private_lens: torch.Tensor,  # [B] tokens in those blocks (>= 1)
    groups: list[DecodeGroup],
    scales: KVScales = UNIT_KV_SCALES,  # an FP8 cache's (ignored by a float cache)
    layer: LayerAttention = FULL_ATTENTION,
) -> torch.Tensor:  # [B, heads, head_dim]
    """A sliding window may end inside a group's shared prefix: the shared part is then
    masked per row (each row's query sits at its own position), still read once per group;
    rows whose window has left the prefix entirely take nothing from it."""
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    g = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, g, head_dim)

    # Private part: every row against its own blocks, padded to the longest.
    width = private_tables.shape[1] * block_size

    def gather(which: int, table: torch.Tensor) -> torch.Tensor:
        flat = torch.index_select(kv_cache[which], 0, table.reshape(-1))
        if is_fp8(kv_cache):
            flat = dequantize_kv(flat, (scales.k, scales.v)[which], q.dtype)
        return flat.view(table.shape[0], -1, num_kv_heads, head_dim).transpose(1, 2)

    # Row b's query sits at private position private_lens[b] - 1 (after its shared prefix).
    private_pos = torch.arange(width, device=q.device)
    valid = layer.visible(private_lens - 1, private_pos)  # [B, width]
    sinks = None if layer.sinks is None else layer.sinks.view(num_kv_heads, g)
    out, lse = attention_with_lse(
        qg, gather(0, private_tables), gather(1, private_tables), valid, layer, sinks
    )  # the sinks join here, once

    # Shared part: each group's queries together against its prefix, read once.
    for grp in groups:
        n = grp.end - grp.start
        keys = gather(0, grp.block_ids[None])  # [1, kvh, S, d]
        values = gather(1, grp.block_ids[None])
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
        total = torch.logaddexp(lse[rows], lse_s)
        out[rows] = (
            out[rows] * torch.exp(lse[rows] - total)[..., None]
            + out_s * torch.exp(lse_s - total)[..., None]
        )
    return out.reshape(num_seqs, num_heads, head_dim)

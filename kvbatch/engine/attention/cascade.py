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

import numpy as np
import torch

from kvbatch.engine.attention.decode_plan import (
    SOLO_PREFIX_MIN_TOKENS,
    DecodeGroup,
    DecodePlan,
    plan_decode,
    with_solo_prefixes,
)
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

__all__ = [
    "SOLO_PREFIX_MIN_TOKENS",
    "DecodeGroup",
    "cascade_decode",
    "find_shared_prefixes",
    "with_solo_prefixes",
]


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
    step's rows in it, so that no column past a group's is ever gathered). Each row may share
    its blocks before the one holding its newest token (that one stays private).

    Rows are sorted by their block tables, so that rows sharing long runs are adjacent, and
    the sorted list is cut where two neighbours share less than half of what a neighbouring
    pair shares: rows of two documents under one system prompt become two groups, each
    sharing its document, not one group sharing the system prompt's block with every
    document in its members' private parts (which made every decode row read its whole
    document per step). A group's shared prefix is the shortest run its neighbours share.
    Vectorised over all rows at once: this runs every decode step.

    Only the columns two rows could share are compared: up to the second largest cap among
    rows of one first block. One long row (a 32k prompt decoding: 2,048 blocks) widens the
    step's tables, but it adds no columns (comparing them all would double this function's
    time, and it runs on the host every decode step).
    """
    rows = np.arange(len(tables)) if rows is None else rows
    n = len(rows)
    caps = (context_lens - 1) // block_size  # every member keeps its newest token private
    first = tables[rows, 0]
    by_first = np.lexsort((caps, first))  # each first block's rows, by cap
    f = first[by_first]
    starts = np.flatnonzero(np.r_[True, f[1:] != f[:-1]])
    sizes = np.diff(np.r_[starts, n])
    candidates = sizes >= min_group
    if not candidates.any():
        return np.argsort(first, kind="stable"), []
    # a run two rows share is at most the smaller one's cap: its first block's second largest
    width = int(caps[by_first][(starts + sizes - 2)[candidates]].max())
    if width <= 0:
        return np.argsort(first, kind="stable"), []
    cols = np.arange(width)[None, :]
    # blocks past a row's cap become a value of its own (from its table row, so that the
    # grouping does not depend on the order the rows come in): no run goes through them
    masked = np.where(cols < caps[:, None], tables[rows, :width], -1 - rows[:, None])
    order = np.lexsort(masked[:, ::-1].T)  # by column 0, then 1, ...: stable
    ordered = masked[order]
    same = ordered[1:] == ordered[:-1]  # [n - 1, width]
    lcp = np.where(same.all(axis=1), width, same.argmin(axis=1))  # neighbours' common run
    neighbour = np.maximum(np.r_[0, lcp[:-1]], np.r_[lcp[1:], 0])
    cut = (lcp == 0) | (2 * lcp < neighbour)
    starts = np.flatnonzero(np.r_[True, cut])
    sizes = np.diff(np.r_[starts, n])
    shared = np.minimum.reduceat(np.r_[np.where(cut, width, lcp), width], starts)
    keep = (sizes >= min_group) & (shared > 0)
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
    plan: DecodePlan | None = None,  # the step's plan for this layer kind (decode_plan.py)
) -> torch.Tensor:  # [B, heads, head_dim]
    """Decode attention by parts: each row against its own blocks (rows_attention: batched by
    length octave, so a row with no group, holding a whole document, pads no other row), each
    group's queries against its shared prefix at once, read once per group (and, with
    `prefixes`, gathered once for as many steps as its blocks stay unwritten), then the sinks.

    A sliding window may end inside a group's shared prefix: the shared part is then masked
    per row (each row's query sits at its own position), still read once per group; rows whose
    window has left the prefix entirely take nothing from it. Without `plan`, the plan is
    worked out here from the other arguments (the backend passes one made once per step)."""
    num_seqs, num_heads, head_dim = q.shape
    view = KVView(kv_cache, scales, q.dtype)
    num_kv_heads, block_size = view.num_kv_heads, view.block_size
    g = num_heads // num_kv_heads
    qg = q.view(num_seqs, num_kv_heads, g, head_dim)

    if plan is None:
        solo = prefixes is not None and written_slots is not None
        plan = plan_decode(
            private_tables, private_lens, groups, written_slots, block_size,
            layer.sliding_window, solo,
        )  # fmt: skip
    groups = plan.groups
    # Row b's query sits at private position private_lens[b] - 1 (after its shared prefix).
    out, lse = rows_attention(qg, view, plan.tables, plan.lens, layer, plan.buckets)

    if prefixes is not None and written_slots is not None:
        shared = prefixes.read(view, [grp.block_ids for grp in groups], plan)
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

"""Decode rows against their own blocks, each row paying for about its own length.

A decode step's rows can differ in length by 10x or more: a row of a document group keeps only
its chunk prompt and answer after the shared prefix (a few hundred tokens), while a row with no
group (a document's last chunk running alone, the first row of the next document) holds a whole
document. One padded batch would make every row gather, score and normalise the longest row's
keys, so the rows are split by length octave (floor(log2)): no row is padded to more than twice
its own length, and each octave is one batched matmul (torch has no varlen attention on the CPU;
vLLM's CPU backend splits its paged-attention work per sequence likewise).

Every part returns its log-sum-exp next to its output, so that parts computed apart (a group's
shared prefix, attention sinks) merge exactly:

    lse = logaddexp(lse_1, lse_2);  out = out_1 * exp(lse_1 - lse) + out_2 * exp(lse_2 - lse)
"""

from __future__ import annotations

import torch

from kvbatch.engine.attention.kv_view import KVView
from kvbatch.engine.attention.layer_spec import (
    FULL_ATTENTION,
    LayerAttention,
    score_scale,
    soft_capped_scores,
)

# Splitting decode rows into length buckets costs a call per bucket (a fixed cost per call,
# whatever its size): worth it only when it saves at least this many padded keys per head and
# a quarter of the padded work.
MIN_PADDED_KEYS_SAVED = 4096


def length_buckets(lens: torch.Tensor) -> list[torch.Tensor] | None:
    """Decode rows grouped by length octave (floor(log2)), so that no row is padded to more
    than twice its own length; None when one call over all rows costs about as much (the
    longest within 2x of the shortest, or little padding saved). A few tensor ops per
    octave: no Python loop over the step's rows, once per layer."""
    if lens.numel() < 2 or bool(lens.max() <= 2 * lens.min()):
        return None
    octave = torch.log2(lens.double()).floor().long()
    buckets = [torch.nonzero(octave == o).flatten() for o in torch.unique(octave).tolist()]
    padded_once = lens.numel() * int(lens.max())
    padded_apart = sum(len(rows) * int(lens[rows].max()) for rows in buckets)
    saved = padded_once - padded_apart
    if saved < MIN_PADDED_KEYS_SAVED or 4 * saved < padded_once:
        return None
    return buckets


def window_tail(
    tables: torch.Tensor, lens: torch.Tensor, window: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows' tables and lengths cut to the blocks that hold their last `window` keys:
    row b keeps the blocks from the one holding key lens[b] - window on (at most
    window // block_size + 2 of them), and its length counts from that block's start, so
    positions stay relative to it and the window mask is unchanged."""
    width = min(tables.shape[1], window // block_size + 2)
    first = (lens - window).clamp_min(0) // block_size  # [B] first block inside the window
    columns = (first[:, None] + torch.arange(width, device=lens.device)).clamp_max(
        tables.shape[1] - 1
    )  # columns past a row's last block are masked: they lie beyond its length
    return tables.gather(1, columns), lens - first * block_size


def attention_with_lse(
    q: torch.Tensor,  # [B, kv_heads, q_per_kv, head_dim]
    k: torch.Tensor,  # [B, kv_heads, S, head_dim]
    v: torch.Tensor,  # [B, kv_heads, S, head_dim]
    valid: torch.Tensor | None,  # [B, S] or 4-D, broadcast to the scores; None: every key valid
    layer: LayerAttention = FULL_ATTENTION,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns log-sum-exp: ([B, kvh, g, d], [B, kvh, g]).
    A row with no valid key (a window that ends before a shared prefix does) gets output 0
    and log-sum-exp -inf, so that merging it adds nothing.

    The scores are exponentiated once, in place, against each row's peak, and the output is
    normalised after the value matmul (on [.., d], not [.., S]): on the CPU the score tensor
    is the largest one a decode step makes per layer, and each pass over it (logsumexp and
    then exp(scores - lse) made three) costs as much as a small matmul."""
    if layer.softcap is None:  # the scale on q ([.., g, d]) costs less than on the scores
        scores = torch.matmul(q * score_scale(q, layer), k.transpose(-1, -2))  # [B, kvh, g, S]
    else:
        scores = soft_capped_scores(q, k, layer)
    if valid is not None:
        valid = valid[:, None, None, :] if valid.dim() == 2 else valid
        scores.masked_fill_(~valid, float("-inf"))
    # a row with no valid key has peak -inf: the floor keeps scores - peak at -inf, not nan
    peak = scores.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(scores.dtype).min)
    probs = scores.sub_(peak).exp_()
    total = probs.sum(dim=-1)  # [B, kvh, g]; 0 for a row with no valid key
    out = torch.matmul(probs, v) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return out, peak[..., 0] + torch.log(total)


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, out_2: torch.Tensor, lse_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention results over disjoint keys merged into the one over all of them
    (`out`'s lse must be finite: a decode row always sees its own newest token)."""
    total = torch.logaddexp(lse, lse_2)
    return out * torch.exp(lse - total)[..., None] + out_2 * torch.exp(lse_2 - total)[..., None], (
        total
    )


def join_sinks(
    out: torch.Tensor,  # [B, kvh, g, d]
    lse: torch.Tensor,  # [B, kvh, g]
    sinks: torch.Tensor,  # [kvh * g] float32: one logit per query head
) -> torch.Tensor:
    """Attention sinks (gpt-oss): each head's learned logit joins the softmax's denominator
    and brings no value, so the output shrinks by exp(lse) / (exp(lse) + exp(sink))."""
    kvh, g = lse.shape[1:]
    if sinks.shape != (kvh * g,):
        raise ValueError(
            f"sinks must have one logit per query head, [{kvh * g}]; got {sinks.shape}"
        )
    sink = sinks.view(kvh, g).to(lse.dtype)
    return out * torch.sigmoid(lse - sink)[..., None]


def rows_attention(
    q: torch.Tensor,  # [B, kv_heads, q_per_kv, head_dim]
    view: KVView,
    tables: torch.Tensor,  # [B, blocks] each row's blocks (a windowed layer's: window_tail's)
    lens: torch.Tensor,  # [B] keys in each row's blocks, the query's own included (>= 1)
    layer: LayerAttention = FULL_ATTENTION,
    buckets: list[tuple[torch.Tensor, int]] | None = None,  # (rows, blocks) per length octave
) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, kvh, g, d], [B, kvh, g])
    """Each row's query (the newest token, at position lens - 1) against its blocks, one
    batched call per length octave (`buckets`, from decode_plan.plan_decode; None: one call
    over all rows)."""
    if buckets is None:
        return _padded_rows(q, view, tables, lens, layer)
    out = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:-1])
    for rows, width in buckets:
        out[rows], lse[rows] = _padded_rows(q[rows], view, tables[rows, :width], lens[rows], layer)
    return out, lse


def _padded_rows(
    q: torch.Tensor, view: KVView, tables: torch.Tensor, lens: torch.Tensor, layer: LayerAttention
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batched call: keys padded to the table's width, masked past each row's length.
    Computed heads first ([kv_heads, B, ...]), the layout the gather gives without a copy."""
    keys, values = view.gather_heads_first(tables)  # [kvh, B, S, d]
    positions = torch.arange(keys.shape[2], device=q.device)
    valid = layer.visible(lens - 1, positions)[None, :, None, :]  # [1, B, 1, S]
    out, lse = attention_with_lse(q.transpose(0, 1), keys, values, valid, layer)
    return out.transpose(0, 1), lse.transpose(0, 1)

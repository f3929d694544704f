"""The reference attention backend: gathers each sequence's blocks and calls SDPA (CPU and CUDA).

With an FP8 cache the gathered blocks are dequantized (stored * scale, in q's dtype) before
SDPA, and a first chunk with nothing cached attends to its own K/V as the cache holds them
(quantized and back), so that every query sees the K/V the Triton kernels see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbatch.engine.attention.cascade import cascade_decode
from kvbatch.engine.attention.layer_spec import FULL_ATTENTION, LayerAttention, attend
from kvbatch.engine.attention.metadata import (
    UNIT_KV_SCALES,
    AttentionMetadata,
    KVScales,
    PrefillSpan,
)
from kvbatch.kernels.kv_quant import dequantize_kv, is_fp8, quantize_kv, round_trip_kv, scatter_rows


class TorchAttentionBackend:
    """Reference backend: gathers a sequence's blocks and calls SDPA. CPU and CUDA."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scales: KVScales = UNIT_KV_SCALES,
        layer: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        write_kv(kv_cache, k, v, meta.slot_mapping, scales)
        if is_fp8(kv_cache):  # the chunks' own K/V as the cache now holds them
            k, v = round_trip_kv(k, scales.k), round_trip_kv(v, scales.v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scales, layer)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, span, scales, layer)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scales: KVScales = UNIT_KV_SCALES,
        layer: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:
        """Decodes in one SDPA call per length bucket (length_buckets), each padded to its
        longest: one 2k-token row among 60-token ones would otherwise make every row gather
        and mask 2k keys, ten times the work of the short rows alone."""
        if meta.decode_groups:
            return cascade_decode(
                q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, meta.decode_groups,
                scales, layer,
            )  # fmt: skip
        view = KVView(kv_cache, scales, q.dtype)
        lens, tables = meta.decode_seq_lens, meta.decode_block_tables
        if layer.sliding_window is not None:  # read only the blocks inside the window
            tables, lens = window_tail(tables, lens, layer.sliding_window, view.block_size)
        buckets = length_buckets(lens)
        if buckets is None:
            return _padded_decode(q, view, tables, lens, layer)
        out = torch.empty_like(q)
        for rows in buckets:
            width = -(-int(lens[rows].max()) // view.block_size)
            out[rows] = _padded_decode(q[rows], view, tables[rows, :width], lens[rows], layer)
        return out

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        scales: KVScales = UNIT_KV_SCALES,
        layer: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:
        """A chunk attends causally (within the layer's window) to its cached prefix and to
        itself."""
        cached = span.context_len - span.query_len
        qh = q.transpose(0, 1)[None]  # [1, heads, q_len, head_dim]
        if cached == 0 and layer.is_plain:  # nothing cached: plain causal attention
            out = F.scaled_dot_product_attention(
                qh,
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=True,
            )
            return out[0].transpose(0, 1)
        first = 0  # the first key position read (a window skips the blocks before it)
        if cached == 0:
            keys, values = k, v
        else:
            view = KVView(kv_cache, scales, q.dtype)
            if layer.sliding_window is not None:
                first = max(0, cached - layer.sliding_window + 1) // view.block_size
                first *= view.block_size
            keys, values = view.gather(span.block_ids[first // view.block_size :])
            keys, values = keys[: span.context_len - first], values[: span.context_len - first]
        # Query i sits at absolute position cached + i and sees keys 0 .. cached + i (and
        # only the last `sliding_window` of them in a windowed layer).
        q_pos = torch.arange(cached, span.context_len, device=q.device)
        k_pos = torch.arange(first, span.context_len, device=q.device)
        mask = layer.visible(q_pos, k_pos)  # [q_len, context_len]
        out = attend(qh, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], mask, layer)
        return out[0].transpose(0, 1)


# Splitting decode rows into length buckets costs an SDPA call per bucket (a fixed cost per
# call, whatever its size): worth it only when it saves at least this many padded keys per head
# and a quarter of the padded work.
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


class KVView:
    """One layer's cache as attention reads it: gathered blocks in the queries' dtype,
    dequantized with `scales` when the cache is FP8 (a float cache is returned as it is)."""

    def __init__(self, kv_cache: torch.Tensor, scales: KVScales, dtype: torch.dtype) -> None:
        self.cache, self.scales, self.dtype = kv_cache, scales, dtype
        _, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.fp8 = is_fp8(kv_cache)

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the listed blocks in order: [blocks * block_size, kv_heads, head_dim]
        each (a 2-D table gives its rows one after another)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        keys = gather_blocks(self.cache[0], block_ids).view(shape)
        values = gather_blocks(self.cache[1], block_ids).view(shape)
        if self.fp8:
            keys = dequantize_kv(keys, self.scales.k, self.dtype)
            values = dequantize_kv(values, self.scales.v, self.dtype)
        return keys, values


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


def _padded_decode(
    q: torch.Tensor,
    view: KVView,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    layer: LayerAttention = FULL_ATTENTION,
) -> torch.Tensor:
    """One SDPA call for decode rows [B, heads, head_dim] over their block tables [B, blocks],
    keys padded to the table's width and masked past each row's length."""
    num_seqs, max_blocks = tables.shape
    block_size, num_kv_heads, head_dim = view.block_size, view.num_kv_heads, view.head_dim
    # [B, max_blocks * block_size, kv_heads, head_dim] -> [B, kv_heads, S, head_dim]
    keys, values = view.gather(tables)
    keys = keys.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = values.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(max_blocks * block_size, device=q.device)
    mask = layer.visible(seq_lens[:, None] - 1, positions)[:, None]  # [B, 1, 1, S]
    out = attend(q[:, :, None, :], keys, values, mask, layer)  # [B, heads, 1, head_dim]
    return out[:, :, 0, :]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy the listed blocks out of one layer's K or V pool, in table order.

    index_select on a flat list of block ids is one contiguous gather; advanced indexing with
    a 2-D table is several times slower on the CPU.
    """
    return torch.index_select(cache, 0, block_ids.reshape(-1))


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    scales: KVScales = UNIT_KV_SCALES,
) -> None:
    """Scatter new K/V rows into their slots (block * block_size + offset), quantized with
    `scales` when the cache is FP8."""
    if is_fp8(kv_cache):
        k, v = quantize_kv(k, scales.k, kv_cache.dtype), quantize_kv(v, scales.v, kv_cache.dtype)
    scatter_rows(kv_cache, k, v, slots)

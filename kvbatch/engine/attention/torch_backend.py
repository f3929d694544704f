"""The reference attention backend: gathers each sequence's blocks and calls SDPA (CPU and CUDA).

With an FP8 cache the gathered blocks are dequantized (stored * scale, in q's dtype) before
SDPA, and a first chunk with nothing cached attends to its own K/V as the cache holds them
(quantized and back), so that every query sees the K/V the Triton kernels see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbatch.engine.attention.cascade import SOLO_PREFIX_MIN_TOKENS, cascade_decode
from kvbatch.engine.attention.decode_rows import length_buckets, window_tail
from kvbatch.engine.attention.kv_view import KVView
from kvbatch.engine.attention.latent import latent_attention_lse, latent_decode_attention
from kvbatch.engine.attention.layer_spec import FULL_ATTENTION, LayerAttention, attend
from kvbatch.engine.attention.metadata import (
    UNIT_KV_SCALES,
    AttentionMetadata,
    KVScales,
    PrefillSpan,
)
from kvbatch.engine.attention.prefix_memo import GatheredPrefixes
from kvbatch.kernels.kv_quant import is_fp8, quantize_kv, round_trip_kv, scatter_rows

__all__ = ["TorchAttentionBackend", "length_buckets", "write_kv"]


class TorchAttentionBackend:
    """Reference backend: gathers a sequence's blocks and calls SDPA. CPU and CUDA."""

    name = "torch"

    def __init__(self) -> None:
        # shared prefixes' gathered K/V, kept across decode steps (engine/attention/prefix_memo.py)
        self.prefixes = GatheredPrefixes()

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
            out[:nd] = self._decode(
                q[:nd], kv_cache, meta, scales, layer, layer.sinks, self.prefixes
            )
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, span, scales, layer)
        return out

    @staticmethod
    def latent_decode(
        q_latent: torch.Tensor,  # [B, H, R] absorbed queries
        q_rope: torch.Tensor,  # [B, H, P]
        latent_cache: torch.Tensor,  # [num_blocks, block_size, R + P]
        block_tables: torch.Tensor,  # [B, max_blocks]
        seq_lens: torch.Tensor,  # [B]
        scale: float,
    ) -> torch.Tensor:  # [B, H, R]
        """MLA decode rows in the latent space (engine/attention/latent.py)."""
        return latent_decode_attention(
            q_latent, q_rope, latent_cache, block_tables, seq_lens, scale
        )

    latent_decode_lse = staticmethod(latent_attention_lse)
    """The same with each row's log-sum-exp, for a shared-prefix group's merge."""

    @staticmethod
    def _decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scales: KVScales = UNIT_KV_SCALES,
        layer: LayerAttention = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,  # [heads] float32: per-head sink logits (gpt-oss)
        prefixes: GatheredPrefixes | None = None,
    ) -> torch.Tensor:
        """Decode rows, each against about its own length: shared-prefix groups and sinks
        through cascade_decode (private parts by length octave, prefixes kept across steps);
        plain rows in one SDPA call per length bucket (length_buckets), each padded to its
        longest: one 2k-token row among 60-token ones would otherwise make every row gather
        and mask 2k keys, ten times the work of the short rows alone."""
        lens = meta.decode_seq_lens
        solo = (  # a long row reads its full blocks through the kept prefixes (cascade.py)
            prefixes is not None
            and layer.sliding_window is None
            and bool(lens.max() >= SOLO_PREFIX_MIN_TOKENS)
        )
        if meta.decode_groups or sinks is not None or solo:
            return cascade_decode(
                q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, meta.decode_groups,
                scales, layer, sinks, prefixes, meta.slot_mapping,
            )  # fmt: skip
        view = KVView(kv_cache, scales, q.dtype)
        if prefixes is not None:  # no group reads a kept prefix this step: let them go
            prefixes.read(view, [], meta.slot_mapping)
        tables = meta.decode_block_tables
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

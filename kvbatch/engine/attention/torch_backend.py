"""The reference attention backend: gathers each sequence's blocks and calls SDPA (CPU and CUDA).

With an FP8 cache the gathered blocks are dequantized (stored * scale, in q's dtype) before
SDPA, and a first chunk with nothing cached attends to its own K/V as the cache holds them
(quantized and back), so that every query sees the K/V the Triton kernels see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbatch.engine.attention.cascade import cascade_decode
from kvbatch.engine.attention.decode_plan import DecodePlan, plan_decode
from kvbatch.engine.attention.decode_rows import length_buckets
from kvbatch.engine.attention.kv_view import KVView
from kvbatch.engine.attention.latent import (
    expanded_prefill_attention,
    latent_attention_lse,
    latent_decode_attention,
)
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

MAX_PLANS = 16  # decode plans kept: one per KV group and window size of the current step


class TorchAttentionBackend:
    """Reference backend: gathers a sequence's blocks and calls SDPA. CPU and CUDA."""

    name = "torch"

    def __init__(self) -> None:
        # shared prefixes' gathered K/V, kept across decode steps (engine/attention/prefix_memo.py)
        self.prefixes = GatheredPrefixes()
        # decode plans of the step's metadata, per window size (engine/attention/decode_plan.py)
        self._plans: dict[tuple, tuple[AttentionMetadata, DecodePlan]] = {}

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
            plan = self._plan(meta, layer, kv_cache.shape[2])
            out[:nd] = self._decode(
                q[:nd], kv_cache, meta, scales, layer, layer.sinks, self.prefixes, plan
            )
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, span, scales, layer)
        return out

    def _plan(self, meta: AttentionMetadata, layer: LayerAttention, block_size: int) -> DecodePlan:
        """The step's decode plan for this layer kind, made by the first layer that reads it.
        A plan holds its metadata, so the metadata's id is not reused while the plan is kept;
        plans of earlier steps go when more than a step's worth (one per KV group and window
        size) have piled up."""
        solo = self.prefixes is not None  # groups of one read through the kept prefixes
        key = (id(meta), layer.sliding_window, block_size, solo)
        held = self._plans.get(key)
        if held is not None and held[0] is meta:
            return held[1]
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        plan = plan_decode(
            meta.decode_block_tables, meta.decode_seq_lens, meta.decode_groups,
            meta.slot_mapping, block_size, layer.sliding_window, solo,
        )  # fmt: skip
        self._plans[key] = (meta, plan)
        return plan

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
    latent_prefill = staticmethod(expanded_prefill_attention)
    """MLA prefill over the expanded context (engine/attention/latent.py)."""

    @staticmethod
    def _decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scales: KVScales = UNIT_KV_SCALES,
        layer: LayerAttention = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,  # [heads] float32: per-head sink logits (gpt-oss)
        prefixes: GatheredPrefixes | None = None,
        plan: DecodePlan | None = None,  # the step's (made here from `meta` when not given)
    ) -> torch.Tensor:
        """Decode rows, each against about its own length: shared-prefix groups and sinks
        through cascade_decode (private parts by length octave, prefixes kept across steps);
        plain rows in one SDPA call per length bucket (length_buckets), each padded to its
        longest: one 2k-token row among 60-token ones would otherwise make every row gather
        and mask 2k keys, ten times the work of the short rows alone. A long row with no group
        reads its full blocks as a group of one through the kept prefixes (decode_plan.py)."""
        block_size = kv_cache.shape[2]
        if plan is None:
            plan = plan_decode(
                meta.decode_block_tables, meta.decode_seq_lens, meta.decode_groups,
                meta.slot_mapping, block_size, layer.sliding_window, solo=prefixes is not None,
            )  # fmt: skip
        if plan.groups or sinks is not None:
            return cascade_decode(
                q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, meta.decode_groups,
                scales, layer, sinks, prefixes, meta.slot_mapping, plan,
            )  # fmt: skip
        view = KVView(kv_cache, scales, q.dtype)
        if prefixes is not None:  # no group reads a kept prefix this step: let them go
            prefixes.release(view)
        tables, lens = plan.tables, plan.lens  # a windowed layer's: the blocks in its window
        if plan.buckets is None:
            return _padded_decode(q, view, tables, lens, layer)
        out = torch.empty_like(q)
        for rows, width in plan.buckets:
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

"""The Triton attention backend: the kernels in kernels/ over the same metadata as the torch one.

Per layer it runs at most four launches, whatever the number of sequences:

    write_kv_cache          every new token's K/V into its slot (negative slots skipped)
    paged_decode_attention  all single-token decodes (their private blocks under cascade)
    paged_prefill_attention all prefill chunks, causal over their cached prefix and themselves
    cascade (decodes only)  each shared-prefix group's queries against its shared blocks once
                            (the prefill kernel, non-causal) merged by log-sum-exp

An FP8 cache passes the layer's k_scale and v_scale to every launch: the write quantizes, the
attention kernels dequantize in registers. The layer's variant (sliding window, scale,
soft-cap: engine/attention/layer_spec.py) goes to every attention launch too; its sinks
(gpt-oss) to the decode and causal prefill launches only, so that a cascade's merge of private
and shared parts counts them once.

The step's packed tensors (prefill tables and lengths, cascade groups) are built once per step
on first use and reused by every layer (`StepTensors`), so a layer pays for launches only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbatch.engine.attention.layer_spec import FULL_ATTENTION, LayerAttention
from kvbatch.engine.attention.metadata import UNIT_KV_SCALES, AttentionMetadata, KVScales
from kvbatch.kernels.kv_quant import is_fp8


@dataclass
class PrefillBatch:
    """All prefill chunks of a step packed for one kernel launch."""

    block_tables: torch.Tensor  # [S, max_blocks]
    query_start: torch.Tensor  # [S]
    query_lens: torch.Tensor  # [S]
    context_lens: torch.Tensor  # [S]
    max_query_len: int
    # The longest context on the host, so the kernel may split a long context's keys across
    # programs (a short chunk of a long prompt); None inside CUDA graphs (cascade groups).
    max_context_len: int | None = None


@dataclass
class StepTensors:
    prefill: PrefillBatch | None
    shared: PrefillBatch | None  # cascade groups as non-causal "sequences" of decode rows


def pack_prefills(meta: AttentionMetadata) -> PrefillBatch | None:
    spans = meta.prefills
    if not spans:
        return None
    r = meta.prefill_ranges
    if r is not None and meta.prefill_block_tables is not None:  # packed by the runner
        max_query_len = max(s.query_len for s in spans)
        max_context_len = max(s.context_len for s in spans)
        return PrefillBatch(
            meta.prefill_block_tables, r[0], r[1], r[2], max_query_len, max_context_len
        )
    return _batch(
        [s.block_ids for s in spans],
        [(s.query_start, s.query_len, s.context_len) for s in spans],
        meta.slot_mapping.device,
        tables=meta.prefill_block_tables,  # None when the metadata was built by hand
    )


def _batch(block_ids, ranges, device, tables=None) -> PrefillBatch:
    """`ranges`: (first query row, query rows, context tokens) per sequence."""
    if tables is None:
        width = max(int(ids.numel()) for ids in block_ids)
        tables = torch.zeros(len(block_ids), width, dtype=torch.int32, device=device)
        for i, ids in enumerate(block_ids):
            tables[i, : ids.numel()] = ids
    # [3, S]: each row contiguous (the kernels index these vectors with unit stride)
    lens = torch.tensor(list(zip(*ranges)), dtype=torch.int32).to(device)
    return PrefillBatch(
        tables, lens[0], lens[1], lens[2], max(r[1] for r in ranges), max(r[2] for r in ranges)
    )


EXPANDED_BLOCK = 16
"""Tokens a block of the expanded K/V an MLA prefill lays out for the prefill kernel."""


class TritonAttentionBackend:
    """Paged attention with the Triton kernels (CUDA; the interpreter runs them on the CPU)."""

    name = "triton"

    def __init__(self) -> None:
        # Imported here: kernels/ imports triton, which the torch backend never needs.
        from kvbatch.kernels.decode_attention import paged_decode_attention
        from kvbatch.kernels.kv_write import write_kv_cache
        from kvbatch.kernels.merge_states import merge_attention_states
        from kvbatch.kernels.mla_attention import mla_decode_attention
        from kvbatch.kernels.prefill_attention import paged_prefill_attention

        self._mla_decode = mla_decode_attention
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention
        self._merge = merge_attention_states
        self._write = write_kv_cache
        self._step_meta: AttentionMetadata | None = None
        self._step: StepTensors | None = None

    def latent_decode(
        self,
        q_latent: torch.Tensor,  # [B, H, R] absorbed queries
        q_rope: torch.Tensor,  # [B, H, P]
        latent_cache: torch.Tensor,  # [num_blocks, block_size, R + P]
        block_tables: torch.Tensor,  # [B, max_blocks]
        seq_lens: torch.Tensor,  # [B]
        scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor:  # [B, H, R] (and lse [B, H] float32 with return_lse)
        """MLA decode rows in the latent space (engine/attention/latent.py):
        kernels/mla_attention.py's `mla_decode_attention`."""
        tables, lens = block_tables.to(torch.int32), seq_lens.to(torch.int32)
        return self._mla_decode(
            q_latent, q_rope, latent_cache, tables, lens, scale, return_lse=return_lse
        )

    def latent_prefill(
        self,
        queries: torch.Tensor,  # [Q, H, N + P] the last Q positions of the context
        keys: torch.Tensor,  # [S, H, N + P]
        values: torch.Tensor,  # [S, H, V], V <= N + P
        scale: float,
    ) -> torch.Tensor:  # [Q, H, V]
        """MLA prefill over the expanded context by the paged prefill kernel: K and V (V
        zero-padded to the key width) laid out as one sequence's cache of
        EXPANDED_BLOCK-token blocks, one KV head per query head."""
        q_len, s = queries.shape[0], keys.shape[0]
        width, v_dim = keys.shape[-1], values.shape[-1]
        blocks = -(-s // EXPANDED_BLOCK)
        cache = keys.new_zeros(2, blocks * EXPANDED_BLOCK, *keys.shape[1:])
        cache[0, :s] = keys
        cache[1, :s, :, :v_dim] = values
        cache = cache.view(2, blocks, EXPANDED_BLOCK, *keys.shape[1:])
        device = queries.device
        out = self._prefill(
            queries.contiguous(),
            cache,
            torch.arange(blocks, dtype=torch.int32, device=device)[None],
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.tensor([q_len], dtype=torch.int32, device=device),
            torch.tensor([s], dtype=torch.int32, device=device),
            q_len,
            scale=scale,
            max_context_len=s,
        )
        return out[..., :v_dim] if width != v_dim else out

    def latent_decode_lse(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """`latent_decode` with each row's log-sum-exp, for a shared-prefix group's merge
        (engine/attention/latent.py's `latent_cascade_decode`)."""
        return self.latent_decode(*args, return_lse=True)

    def step_tensors(self, meta: AttentionMetadata) -> StepTensors:
        """Packed once per step (keyed by the metadata object), reused by every layer."""
        if self._step_meta is not meta:
            shared = None
            if meta.decode_group_ranges is not None:  # packed by the runner (or a CUDA graph)
                r = meta.decode_group_ranges
                tables, rows = meta.decode_group_tables, meta.decode_group_max_rows
                shared = PrefillBatch(tables, r[0], r[1], r[2], rows)
            elif meta.decode_groups:
                raise ValueError(
                    "decode_groups need decode_group_tables and decode_group_ranges for the "
                    "triton backend (engine/exec/runner.py packs them)"
                )
            self._step = StepTensors(pack_prefills(meta), shared)
            self._step_meta = meta
        return self._step

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scales: KVScales = UNIT_KV_SCALES,
        layer: LayerAttention = FULL_ATTENTION,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        if not is_fp8(kv_cache):
            scales = UNIT_KV_SCALES
        kv = dict(k_scale=scales.k, v_scale=scales.v)
        # the layer's variant, passed to every attention kernel
        kv.update(scale=layer.scale, softcap=layer.softcap, sliding_window=layer.sliding_window)
        self._write(kv_cache, k, v, meta.slot_mapping, k_scale=scales.k, v_scale=scales.v)
        step = self.step_tensors(meta)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            self._decode_rows(q[:nd], kv_cache, meta, step, out[:nd], kv, layer.sinks)
        if step.prefill is not None:
            p = step.prefill
            self._prefill(
                q,
                kv_cache,
                p.block_tables,
                p.query_start,
                p.query_lens,
                p.context_lens,
                p.max_query_len,
                causal=True,
                out=out,
                max_context_len=p.max_context_len,
                sinks=layer.sinks,
                **kv,
            )
        return out

    def _decode_rows(self, q, kv_cache, meta, step: StepTensors, out, kv: dict, sinks) -> None:
        """`kv`: the cache's k_scale and v_scale, passed to every kernel."""
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        if step.shared is None:
            self._decode(q, kv_cache, tables, lens, out=out, sinks=sinks, **kv)
            return
        # Cascade: private blocks per row (with the sinks), shared blocks once per group,
        # merged exactly.
        private, lse_p = self._decode(q, kv_cache, tables, lens, return_lse=True, sinks=sinks, **kv)
        s = step.shared
        # Rows outside every group get lse -inf from the kernel: the merge keeps their private
        # part as it is (whatever their unwritten `shared` rows hold).
        shared, lse_s = self._prefill(
            q,
            kv_cache,
            s.block_tables,
            s.query_start,
            s.query_lens,
            s.context_lens,
            s.max_query_len,
            causal=False,
            out=torch.empty_like(q),
            return_lse=True,
            # a window may end inside the shared prefix: each row's query sits after it, at
            # its private length
            row_offsets=lens if kv["sliding_window"] is not None else None,
            **kv,
        )
        self._merge(private, lse_p, shared, lse_s, out=out)

"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Mistral 4) over the paged latent cache.

    q       = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))      [T, H, N + P]
              = [q_nope (N) | q_rope (P)] per head
    latent  = kv_a_proj_with_mqa(x) = [c_kv (R) | k_rope (P)];  c_kv = kv_a_layernorm(c_kv)
    q_rope, k_rope rotated (k_rope is one key shared by all heads)
    cache   <- [c_kv | k_rope] at each token's slot                   (R + P per token)

    kv_b_proj.weight = [H, N + V, R]: W_UK (its first N rows per head), W_UV (its last V)

Two attention paths give the same numbers (to rounding):

- **prefill, expanded** (a chunk of many queries: compute-bound). The chunk's context
  latents (cached prefix and itself) go through kv_b_proj to per-head k_nope and v; each key
  is [k_nope | k_rope], each query [q_nope | q_rope], and ordinary causal attention runs with
  qk dim N + P and v dim V.
- **decode, absorbed** (one query per row: memory-bound). q_nope . (W_UK c) = (W_UK^T q_nope)
  . c, so the query is moved into the latent space once (q_latent = q_nope W_UK, [H, R]) and
  the heads attend over the cached latents themselves (engine/attention/latent.py; MQA with
  one KV head of R + P, value = its first R), then W_UV maps the [H, R] result to [H, V]. No
  per-token expansion: a decode step reads R + P values per cached token.

The rotary dims come interleaved in DeepSeek's checkpoints (`rope_interleave`: pairs (x0, x1),
(x2, x3), ...); transformers rotates them as the halves [x0, x2, ... | x1, x3, ...], and so
do we (`pairs_to_halves`), so the cache holds k_rope in that order, already rotated. YaRN's
attention scale (mscale squared) is in the softmax scale (engine/model/latent_attention.py);
Mistral 4 also multiplies each query by its position's scale (`query_scale`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvbatch.engine.attention.latent import (
    gather_latents,
    latent_cascade_decode,
    latent_view,
    write_latent,
)
from kvbatch.engine.attention.metadata import AttentionMetadata, PrefillSpan
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.layers.rotary import Rotation
from kvbatch.engine.model.latent_attention import LatentAttentionConfig

LATENT_NORM_EPS = 1e-6
"""q_a_layernorm's and kv_a_layernorm's epsilon: transformers builds them with the RMSNorm
default, not the config's rms_norm_eps."""


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs (x0, x1), (x2, x3), ... as [x0, x2, ... | x1, x3, ...], the
    rotate-half layout whose rotation equals the interleaved one (transformers'
    apply_rotary_pos_emb_interleave writes its output in this order too)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """`self_attn.*` of an MLA layer; parameter names as the checkpoints'."""

    def __init__(self, hidden_size: int, cfg: LatentAttentionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, qk = cfg.num_heads, cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, cfg.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * cfg.v_head_dim, hidden_size, bias=cfg.attention_bias)
        # a quantized kv_b_proj's dequantized weight, made once for the absorbed decode
        self._up_weight: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotation: Rotation,
        kv_cache: torch.Tensor,  # [1, blocks, block_size, 1, R + P]
        meta: AttentionMetadata,
        backend,
        query_scale: torch.Tensor | None = None,  # [T] Mistral 4's per-position factor
    ) -> torch.Tensor:  # [T, hidden]
        cfg = self.cfg
        t, n, r = x.shape[0], cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = self._queries(x).view(t, cfg.num_heads, cfg.qk_head_dim)
        latent = self.kv_a_proj_with_mqa(x)  # [T, R + P]
        c_kv = self.kv_a_layernorm(latent[:, :r])
        q_rope, k_rope = q[..., n:], latent[:, None, r:]
        if cfg.rope_interleave:
            q_rope, k_rope = pairs_to_halves(q_rope), pairs_to_halves(k_rope)
        q_rope, k_rope = rotation(q_rope.contiguous(), k_rope.contiguous())
        q_nope = q[..., :n]
        if query_scale is not None:
            scale = query_scale[:, None, None]
            q_nope, q_rope = q_nope * scale, q_rope * scale
        entries = torch.cat((c_kv, k_rope[:, 0]), dim=-1)  # [T, R + P]
        write_latent(kv_cache, entries, meta.slot_mapping)
        out = x.new_empty(t, cfg.num_heads, cfg.v_head_dim)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self.decode(q_nope[:nd], q_rope[:nd], kv_cache, meta, backend)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            out[rows] = self.prefill(
                q_nope[rows], q_rope[rows], entries[rows], kv_cache, span, backend
            )
        return self.o_proj(out.view(t, -1))

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def up_projections(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, N, R] and W_UV [H, V, R]: views of kv_b_proj's weight (a quantized
        layer's dequantized once)."""
        cfg = self.cfg
        weight = getattr(self.kv_b_proj, "weight", None)
        if not isinstance(self.kv_b_proj, nn.Linear):
            if self._up_weight is None or self._up_weight.dtype != dtype:
                self._up_weight = self.kv_b_proj.dequantize(dtype)
            weight = self._up_weight
        w = weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    def decode(
        self,
        q_nope: torch.Tensor,  # [B, H, N]
        q_rope: torch.Tensor,  # [B, H, P]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:  # [B, H, V]
        """Absorbed decode: attention in the latent space (the module doc)."""
        w_uk, w_uv = self.up_projections(q_nope.dtype)
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        latent = latent_view(kv_cache)
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        if meta.decode_groups:  # shared prefixes read once per group, merged exactly
            out_latent = latent_cascade_decode(
                q_latent, q_rope, latent, tables, lens, meta.decode_groups, self.cfg.scale,
                attend=backend.latent_decode_lse,
            )  # fmt: skip
        else:
            out_latent = backend.latent_decode(
                q_latent, q_rope, latent, tables, lens, self.cfg.scale
            )
        return torch.einsum("bhr,hvr->bhv", out_latent, w_uv)

    def prefill(
        self,
        q_nope: torch.Tensor,  # [Q, H, N]
        q_rope: torch.Tensor,  # [Q, H, P]
        entries: torch.Tensor,  # [Q, R + P] the chunk's own latents
        kv_cache: torch.Tensor,
        span: PrefillSpan,
        backend,
    ) -> torch.Tensor:  # [Q, H, V]
        """Expanded prefill: the context's latents to per-head K and V, causal attention."""
        cfg = self.cfg
        h, n, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        cached = span.context_len - span.query_len
        if cached:
            context = gather_latents(kv_cache, span.block_ids, span.context_len).to(q_nope.dtype)
        else:
            context = entries
        s = context.shape[0]
        kv = self.kv_b_proj(context[:, :r]).view(s, h, n + cfg.v_head_dim)
        keys = torch.cat((kv[..., :n], context[:, None, r:].expand(s, h, -1)), dim=-1)
        queries = torch.cat((q_nope, q_rope), dim=-1)
        return backend.latent_prefill(queries, keys, kv[..., n:], cfg.scale)

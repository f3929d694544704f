"""Self-attention over the paged KV cache, as every decoder architecture here runs it:

    qkv = qkv_proj(x)                  one GEMM (linear.py), split into q, k, v heads
    q, k = q_norm(q), k_norm(k)        per-head RMSNorm where the model has it (Qwen3, Gemma 3)
    q, k = rotation(q, k)              RoPE (rotary.py), the layer's own positions' rotation
    out = backend.forward(...)         the engine's attention backend (engine/attention/)
    return o_proj(out)

The layer's variant (sliding window, score scale, soft-cap: engine/attention/layer_spec.py),
its sink logits where the model has them (gpt-oss: `sinks`, one per head) and its FP8 KV-cache
scales reach the backend with the call."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvbatch.engine.attention.layer_spec import LayerAttention
from kvbatch.engine.attention.metadata import UNIT_KV_SCALES, AttentionMetadata, KVScales
from kvbatch.engine.layers.linear import MergedLinear
from kvbatch.engine.layers.rotary import Rotation


class SelfAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        variant: LayerAttention,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        head_norm: Callable[[int], nn.Module] | None = None,  # builds q_norm and k_norm
        sinks: bool = False,  # a learned sink logit per head (gpt-oss)
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.variant = variant  # window, scale, soft-cap
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden_size, bias=o_bias)
        self.qkv_proj = MergedLinear("q_proj", "k_proj", "v_proj")
        # An FP8 KV cache's scales for this layer: the loader sets a checkpoint's calibrated
        # k_scale / v_scale (kv_cache_scheme); float caches ignore them.
        self.kv_scales: KVScales = UNIT_KV_SCALES
        if head_norm is not None:
            self.q_norm, self.k_norm = head_norm(head_dim), head_norm(head_dim)
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotation: Rotation,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation(q, k)
        variant = self.variant.with_sinks(self.sinks)
        out = backend.forward(q, k, v, kv_cache, meta, self.kv_scales, variant)
        return self.o_proj(out.reshape(t, q_size))

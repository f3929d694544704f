"""Gated full attention (Qwen3-Next, Qwen3.5): self-attention over the paged KV cache whose
output is scaled by a sigmoid gate the q projection also produces.

    q_proj(x) per head: [ q_h | gate_h ]    (2 x head_dim per head, interleaved by head)
    q, k = q_norm(q), k_norm(k)             zero-centred RMSNorm per head
    q, k = rotation(q, k)                   partial RoPE (the first 25% of head_dim)
    out = attention(q, k, v) * sigmoid(gate)
    return o_proj(out)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvbatch.engine.attention.layer_spec import FULL_ATTENTION
from kvbatch.engine.attention.metadata import UNIT_KV_SCALES, AttentionMetadata, KVScales
from kvbatch.engine.layers.rotary import Rotation


class GatedSelfAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        head_norm: Callable[[int], nn.Module],
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm, self.k_norm = head_norm(head_dim), head_norm(head_dim)
        self.kv_scales: KVScales = UNIT_KV_SCALES

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rotation: Rotation,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q_gate = self.q_proj(x).view(t, h, 2 * d)
        q, gate = q_gate[..., :d].contiguous(), q_gate[..., d:].reshape(t, h * d)
        k = self.k_proj(x).view(t, self.num_kv_heads, d)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        q, k = rotation(self.q_norm(q), self.k_norm(k))
        out = backend.forward(q, k, v, kv_cache, meta, self.kv_scales, FULL_ATTENTION)
        return self.o_proj(out.reshape(t, h * d) * torch.sigmoid(gate))

"""Gemma 2 and Gemma 3 (text): the transformer of engine/model/llama.py with Gemma's changes.

Per layer, against Llama's:

    x += post_attn_norm(attention(input_norm(x)))       Llama: x += attention(input_norm(x))
    x += post_ffn_norm(mlp(pre_ffn_norm(x)))                   x += mlp(post_attn_norm(x))

- RMSNorm multiplies by (1 + w), in float32 before the cast back (w is stored around zero);
- the MLP is GeGLU: down(gelu_tanh(gate(x)) * up(x));
- embeddings are scaled by sqrt(hidden_size) (rounded to the model's dtype first, as
  transformers does);
- attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- layers alternate local (sliding-window) and global attention (`layer_types`);
- Gemma 2 soft-caps the attention logits and the final logits (cap * tanh(x / cap));
- Gemma 3 norms q and k per head (the same (1 + w) RMSNorm) and rotates its local layers with
  their own RoPE base (rope_parameters["sliding_attention"]).

The attention variants (window, scale, soft-cap) reach the backends as a LayerAttention per
layer; the KV cache, scheduler and backends are Llama's. The triton backend runs the same
layers with fused GEMMs and kernels (engine/model/gemma_fused.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvbatch.engine.attention.layer_spec import LayerAttention
from kvbatch.engine.attention.metadata import UNIT_KV_SCALES, AttentionMetadata, KVScales
from kvbatch.engine.model.architectures import GEMMA_ARCHITECTURES
from kvbatch.engine.model.gemma_fused import gemma_fused_forward
from kvbatch.engine.model.rope import RopeConfig, RotaryEmbedding, rope_config_from_hf


@dataclass(frozen=True)
class GemmaConfig:
    """What a Gemma config adds to ModelConfig's shape."""

    query_pre_attn_scalar: float
    attn_logit_softcap: float | None = None  # Gemma 2 (Gemma 3's config key is unused)
    final_logit_softcap: float | None = None  # Gemma 2, and Gemma 3 where its config sets one
    qk_norm: bool = False  # Gemma 3
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' RoPE (base 10k)

    @classmethod
    def from_hf(cls, architecture: str, hf_config, head_dim: int) -> GemmaConfig | None:
        """Gemma's settings from a transformers config; None for other architectures."""
        if architecture not in GEMMA_ARCHITECTURES:
            return None
        gemma3 = architecture == "Gemma3ForCausalLM"
        local_rope = None
        params = getattr(hf_config, "rope_parameters", None) or {}
        if gemma3 and "sliding_attention" in params:
            local_rope = rope_config_from_hf(hf_config, head_dim, params["sliding_attention"])
        elif gemma3:  # a transformers 4 config: rope_local_base_freq
            theta = getattr(hf_config, "rope_local_base_freq", 10000.0)
            local_rope = RopeConfig(head_dim=head_dim, theta=float(theta))
        # Gemma 3 replaced the attention soft-cap by q/k norms: transformers' Gemma 3 attention
        # never reads attn_logit_softcapping, so a value there changes nothing
        attn_cap = None if gemma3 else getattr(hf_config, "attn_logit_softcapping", None)
        return cls(
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
            attn_logit_softcap=attn_cap,
            final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
            qk_norm=gemma3,
            local_rope=local_rope,
        )

    def layer_attention(self, sliding_window: int | None) -> LayerAttention:
        return LayerAttention(
            sliding_window=sliding_window,
            scale=self.query_pre_attn_scalar**-0.5,
            softcap=self.attn_logit_softcap,
        )


def global_rope_params(hf_config) -> dict | None:
    """The global layers' RoPE parameters of a Gemma 3 config (transformers 5 nests them by
    layer type); None where the config is flat (Gemma 2, transformers 4)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return params.get("full_attention")


class GemmaRMSNorm(nn.Module):
    """RMSNorm times (1 + w), all in float32, then cast (transformers' Gemma order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, cfg, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.is_sliding = cfg.is_sliding(layer)
        self.variant: LayerAttention = cfg.layer_attention(layer)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.kv_scales: KVScales = UNIT_KV_SCALES
        if cfg.gemma.qk_norm:
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos_sin, kv_cache, meta: AttentionMetadata, backend) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = backend.forward(q, k, v, kv_cache, meta, self.kv_scales, self.variant)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class GemmaMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(cfg, layer)
        self.mlp = GemmaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos_sin, kv_cache, meta, backend) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta, backend)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class GemmaBackbone(nn.Module):
    """`model.*` of a Gemma checkpoint."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text models; the same call as LlamaForCausalLM's. The triton backend
    runs `fused_forward` (engine/model/gemma_fused.py: fused GEMMs and norm kernels) instead,
    through engine/model/fused.py model_forward."""

    fused_forward = gemma_fused_forward

    def __init__(self, cfg) -> None:
        super().__init__()
        self.config = cfg
        self.model = GemmaBackbone(cfg)
        self.rotary = RotaryEmbedding(cfg.rope)  # global layers (and every layer of Gemma 2)
        self.local_rotary = RotaryEmbedding(cfg.gemma.local_rope or cfg.rope)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def output_embedding(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def rebuild_rotary(self, device) -> None:
        """RoPE buffers on `device` (the loader builds modules on the meta device)."""
        self.rotary = RotaryEmbedding(self.config.rope).to(device)
        self.local_rotary = RotaryEmbedding(self.config.gemma.local_rope or self.config.rope)
        self.local_rotary.to(device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend,
        logits_indices: torch.Tensor | None = None,
        final_hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [len(logits_indices) or T, vocab] float32
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the activations' dtype first, as transformers multiplies
        x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        global_cs = self.rotary.cos_sin(positions, x.dtype)
        local_cs = self.local_rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            cos_sin = local_cs if layer.self_attn.is_sliding else global_cs
            x = layer(x, cos_sin, kv_cache, meta, backend)
        if final_hidden is not None:
            final_hidden.append(self.model.norm(x))
        if logits_indices is not None:
            x = x[logits_indices]
        logits = F.linear(self.model.norm(x), self.output_embedding).float()
        cap = self.config.gemma.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

"""OLMo 3 (and OLMo 2's layer it keeps): Llama's parts in another order, with local layers.

Per layer, against Llama's:

    x += post_attn_norm(attention(x))        Llama: x += attention(input_norm(x))
    x += post_ffn_norm(mlp(x))                      x += mlp(post_attn_norm(x))

- no pre-norms: each sublayer reads the residual stream itself, and its OUTPUT is normed;
- q and k are RMS-normed over the whole projection (all heads at once: one weight of
  num_heads x head_dim), before the heads are split and rotated (Qwen3 norms each head);
- layers are sliding-window or full (`layer_types`, window `sliding_window`), each type with
  its own RoPE (`rope_parameters["sliding_attention"]` / `["full_attention"]`): the window
  groups of engine/kv free the local layers' old blocks, as for Gemma 2/3;
- the RMSNorm multiplies by w in float32 and then casts (Llama casts first): the same in float32.

The MLP is Llama's SwiGLU; biases on q/k/v/o where `attention_bias` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvbatch.engine.attention.metadata import AttentionMetadata, GroupedAttention, per_layer
from kvbatch.engine.layers.attention import SelfAttention
from kvbatch.engine.layers.logits import final_logits
from kvbatch.engine.layers.mlp import GatedMLP
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.layers.rotary import RotaryEmbedding, Rotation
from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.model.rope import RopeConfig, rope_config_from_hf


@dataclass(frozen=True)
class Olmo3Config:
    """The sliding layers' RoPE (the full layers' is ModelConfig.rope)."""

    local_rope: RopeConfig

    @classmethod
    def from_hf(cls, hf_config, fields: dict) -> Olmo3Config:
        params = getattr(hf_config, "rope_parameters", None) or {}
        local = params.get("sliding_attention") if "sliding_attention" in params else None
        if local is None:  # a flat rope_parameters: every layer rotates alike
            return cls(local_rope=fields["rope"])
        return cls(local_rope=rope_config_from_hf(hf_config, fields["head_dim"], local))


class OlmoRMSNorm(RMSNorm):
    """OLMo's RMSNorm: w times the float32 normed row, then the cast (transformers' order)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class Olmo3Attention(SelfAttention):
    """SelfAttention whose q and k norms span the whole projection, before the head split."""

    def __init__(self, cfg, layer: int) -> None:
        super().__init__(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.layer_attention(layer),
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
        )
        eps = cfg.rms_norm_eps
        self.q_norm = OlmoRMSNorm(cfg.num_heads * cfg.head_dim, eps)
        self.k_norm = OlmoRMSNorm(cfg.num_kv_heads * cfg.head_dim, eps)

    def forward(self, x, rotation: Rotation, kv_cache, meta: AttentionMetadata, backend):
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :q_size]).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(qkv[:, q_size : q_size + kv_size]).view(t, self.num_kv_heads, -1)
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)
        q, k = rotation(q, k)
        out = backend.forward(q, k, v, kv_cache, meta, self.kv_scales, self.variant)
        return self.o_proj(out.reshape(t, q_size))


class Olmo3DecoderLayer(nn.Module):
    """Post-norm sublayers. Returns (the FFN's normed output, the residual stream before it):
    the next layer, or the final norm, adds the one to the other."""

    def __init__(self, cfg, layer: int) -> None:
        super().__init__()
        self.is_sliding = cfg.is_sliding(layer)
        self.self_attn = Olmo3Attention(cfg, layer)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu")
        self.post_attention_layernorm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rotation, kv_cache, meta, backend):
        stream = x if residual is None else residual + x
        stream = stream + self.post_attention_layernorm(
            self.self_attn(stream, rotation, kv_cache, meta, backend)
        )
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo3Backbone(nn.Module):
    """`model.*` of an OLMo 3 checkpoint."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Olmo3DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = OlmoRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Olmo3ForCausalLM(nn.Module):
    """OLMo 3; the same call as LlamaForCausalLM's."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.config = cfg
        self.model = Olmo3Backbone(cfg)
        self.rotary = RotaryEmbedding(cfg.rope)  # full layers
        self.local_rotary = RotaryEmbedding(cfg.family.local_rope)
        if not cfg.tie_word_embeddings and cfg.has_lm_head:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def output_embedding(self) -> torch.Tensor:
        if self.config.tie_word_embeddings or not self.config.has_lm_head:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def rebuild_rotary(self, device) -> None:
        """RoPE buffers on `device` (the loader builds modules on the meta device)."""
        self.rotary.rebuild(device)
        self.local_rotary.rebuild(device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | GroupedAttention,
        backend,
        logits_indices: torch.Tensor | None = None,
        final_hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [len(logits_indices) or T, vocab] float32
        x = self.model.embed_tokens(input_ids)
        global_rotation = self.rotary(positions, x.dtype)
        local_rotation = self.local_rotary(positions, x.dtype)
        residual = None
        layers = self.model.layers
        for layer, kv_cache, layer_meta in zip(layers, kv_caches, per_layer(meta, len(layers))):
            rotation = local_rotation if layer.is_sliding else global_rotation
            x, residual = layer(x, residual, rotation, kv_cache, layer_meta, backend)
        return final_logits(
            self.model.norm, x, residual, self.output_embedding, logits_indices, final_hidden
        )


register_architecture(
    Architecture(
        "Olmo3ForCausalLM",
        "olmo3",
        Olmo3ForCausalLM,
        "Olmo3Model",
        attention_bias=True,
        read_family_config=Olmo3Config.from_hf,
    )
)

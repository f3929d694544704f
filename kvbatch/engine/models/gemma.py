"""Gemma 2 and Gemma 3 (text): the transformer of engine/models/llama.py with Gemma's changes.

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
layer; the KV cache, scheduler and backends are Llama's, and so are the layers
(engine/layers/), which pick their torch or Triton kernels by backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kvbatch.engine.attention.layer_spec import LayerAttention
from kvbatch.engine.attention.metadata import AttentionMetadata, GroupedAttention, per_layer
from kvbatch.engine.layers.attention import SelfAttention
from kvbatch.engine.layers.logits import final_logits
from kvbatch.engine.layers.mlp import GatedMLP
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.layers.rotary import RotaryEmbedding
from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.model.rope import RopeConfig, rope_config_from_hf

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


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


def gemma_norm(dim: int, eps: float) -> RMSNorm:
    """Gemma's RMSNorm: times (1 + w), in float32 before the cast (transformers' order)."""
    return RMSNorm(dim, eps, unit_offset=True)


class GemmaDecoderLayer(nn.Module):
    """Gemma norms each sublayer's output before adding it to the residual stream, so the add
    that fuses into a norm is the one feeding the NEXT pre-norm, not the post-norm itself:

        h, x = input_norm(p, x)       x += p (the last layer's post-FFN output), h = norm(x)
        p = post_attn_norm(attn(h))   norm alone
        h, x = pre_ffn_norm(p, x)
        p = post_ffn_norm(mlp(h))     added by the next layer's input norm (or the final one)
    """

    def __init__(self, cfg, layer: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.is_sliding = cfg.is_sliding(layer)  # local layers rotate with the local RoPE
        self.self_attn = SelfAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.layer_attention(layer),
            head_norm=(lambda dim: gemma_norm(dim, eps)) if cfg.gemma.qk_norm else None,
        )
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, "gelu_tanh")
        self.input_layernorm = gemma_norm(cfg.hidden_size, eps)
        self.post_attention_layernorm = gemma_norm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = gemma_norm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = gemma_norm(cfg.hidden_size, eps)

    def forward(self, x, residual, rotation, kv_cache, meta, backend):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(h, rotation, kv_cache, meta, backend))
        h, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class GemmaBackbone(nn.Module):
    """`model.*` of a Gemma checkpoint."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = gemma_norm(cfg.hidden_size, cfg.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text models; the same call as LlamaForCausalLM's."""

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
        self.rotary.rebuild(device)
        self.local_rotary.rebuild(device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | GroupedAttention,  # GroupedAttention: window groups
        backend,
        logits_indices: torch.Tensor | None = None,
        final_hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [len(logits_indices) or T, vocab] float32
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the activations' dtype first, as transformers multiplies
        x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        global_rotation = self.rotary(positions, x.dtype)
        local_rotation = self.local_rotary(positions, x.dtype)
        residual = None
        layers = self.model.layers
        for layer, kv_cache, layer_meta in zip(layers, kv_caches, per_layer(meta, len(layers))):
            rotation = local_rotation if layer.is_sliding else global_rotation
            x, residual = layer(x, residual, rotation, kv_cache, layer_meta, backend)
        logits = final_logits(
            self.model.norm, x, residual, self.output_embedding, logits_indices, final_hidden
        )
        cap = self.config.gemma.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


# Gemma's MLP runs the tanh-approximate GELU, under either of its names; `hidden_act`, where a
# Gemma config also has it, is the same GELU and not read.
for _name, _model_type in zip(GEMMA_ARCHITECTURES, ("gemma2", "gemma3_text")):
    register_architecture(
        Architecture(
            _name,
            _model_type,
            GemmaForCausalLM,
            activations=("gelu_pytorch_tanh", "gelu_tanh"),
            activation_key="hidden_activation",
        )
    )

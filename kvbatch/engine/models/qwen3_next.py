"""Hybrid linear-attention models: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, composed from
engine/layers/.

Three Gated DeltaNet layers (engine/layers/gated_delta_net.py: linear attention with a
fixed-size state per sequence) come before each gated full-attention layer
(engine/layers/gated_attention.py); config.json's `layer_types` says which is which. Every
norm is zero-centred (1 + w) except the DeltaNet's gated norm. The feed-forward is a SwiGLU MLP
(Qwen3.5) or routed experts with a sigmoid-gated shared expert (Qwen3-Next: the layers that
decoder_sparse_step and mlp_only_layers make sparse; Qwen3.5-MoE: every layer).

The full-attention layers read and write the paged KV cache as any model does; only they have
a KV tensor (ModelConfig.num_kv_layers). The linear layers read and write the state pool
(engine/kv/state_slots.py) through the StatefulMeta the runner builds for each step.

Checkpoints: Qwen3-Next fuses q, k, v, z into `in_proj_qkvz` and b, a into `in_proj_ba`, laid
out per key head; they are split at load into Qwen3.5's `in_proj_qkv`, `_z`, `_b`, `_a`, so one
layer serves both. The multi-token-prediction weights (`mtp.*`) are not used (they could drive
speculative decoding later) and are dropped with a log line. Published Qwen3.5 checkpoints
are vision-language (Qwen3_5ForConditionalGeneration): their language model is loaded and
images are not read (engine/model/multimodal.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvbatch.engine.attention.metadata import AttentionMetadata
from kvbatch.engine.kv.state_slots import StatefulMeta, fresh_states
from kvbatch.engine.kv.stateful import state_shape
from kvbatch.engine.layers.gated_attention import GatedSelfAttention
from kvbatch.engine.layers.gated_delta_net import GatedDeltaNet
from kvbatch.engine.layers.logits import final_logits
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.layers.rotary import RotaryEmbedding
from kvbatch.engine.model.linear_attention import LINEAR, LinearAttentionConfig
from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.models.llama import ModelConfig, feed_forward

log = logging.getLogger(__name__)


def zero_centred_norm(dim: int, eps: float) -> RMSNorm:
    return RMSNorm(dim, eps, unit_offset=True)


class HybridDecoderLayer(nn.Module):
    """A linear-attention or a gated full-attention layer, then the feed-forward; pre-norm,
    the residual add fused into each norm as in the Llama layer."""

    def __init__(self, cfg: ModelConfig, layer: int, linear_index: int, kv_index: int) -> None:
        super().__init__()
        lin = cfg.linear
        self.is_linear = lin.layer_types[layer] == LINEAR
        self.kv_index = kv_index  # this layer's KV tensor (full attention only)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, lin, cfg.rms_norm_eps, linear_index)
        else:
            self.self_attn = GatedSelfAttention(
                cfg.hidden_size,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                lambda dim: zero_centred_norm(dim, cfg.rms_norm_eps),
                bias=cfg.o_bias,
            )
        self.mlp = feed_forward(cfg, layer)
        self.input_layernorm = zero_centred_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = zero_centred_norm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rotation, kv_caches, meta: StatefulMeta, backend):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.is_linear:
            x = self.linear_attn(h, meta.states, meta.pool)
        else:
            x = self.self_attn(h, rotation, kv_caches[self.kv_index], meta.attention, backend)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual


class HybridBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, linear, kv = [], 0, 0
        for i, kind in enumerate(cfg.linear.layer_types):
            layers.append(HybridDecoderLayer(cfg, i, linear, kv))
            linear, kv = (linear + 1, kv) if kind == LINEAR else (linear, kv + 1)
        self.layers = nn.ModuleList(layers)
        self.norm = zero_centred_norm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridForCausalLM(nn.Module):
    """Parameter names match Hugging Face's (after the Qwen3-Next split), so a checkpoint's
    state dict loads as it is."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.linear is None:
            raise ValueError(f"{cfg.architecture} has no linear-attention config")
        self.config = cfg
        self.model = HybridBackbone(cfg)
        self.rotary = RotaryEmbedding(cfg.rope)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def rebuild_rotary(self, device) -> None:
        self.rotary.rebuild(device)

    @property
    def output_embedding(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one per full-attention layer
        meta: StatefulMeta | AttentionMetadata,  # plain: every chunk starts from zero states
        backend,
        logits_indices: torch.Tensor | None = None,
        final_hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if not isinstance(meta, StatefulMeta):  # outside the runner: every chunk from zero
            meta = fresh_states(meta, state_shape(self.config.linear), x.dtype, x.device)
        rotation = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rotation, kv_caches, meta, backend)
        return final_logits(
            self.model.norm, x, residual, self.output_embedding, logits_indices, final_hidden
        )


def adapt_hybrid_checkpoint(state_dict: dict[str, torch.Tensor], cfg: ModelConfig):
    """Drop the MTP weights; split Qwen3-Next's fused projections (see the module doc)."""
    mtp = [k for k in state_dict if k.startswith("mtp.")]
    if mtp:
        log.info(
            "%s: %d multi-token-prediction tensors (mtp.*) are not used",
            cfg.architecture,
            len(mtp),
        )
        for k in mtp:
            del state_dict[k]
    if cfg.linear.fused_projections:
        for name in [k for k in state_dict if k.endswith(".linear_attn.in_proj_qkvz.weight")]:
            prefix = name.removesuffix("in_proj_qkvz.weight")
            qkv, z = split_qkvz(state_dict.pop(name), cfg.linear)
            state_dict[prefix + "in_proj_qkv.weight"] = qkv
            state_dict[prefix + "in_proj_z.weight"] = z
        for name in [k for k in state_dict if k.endswith(".linear_attn.in_proj_ba.weight")]:
            prefix = name.removesuffix("in_proj_ba.weight")
            b, a = split_ba(state_dict.pop(name), cfg.linear)
            state_dict[prefix + "in_proj_b.weight"] = b
            state_dict[prefix + "in_proj_a.weight"] = a
    return state_dict


def split_qkvz(weight: torch.Tensor, lin: LinearAttentionConfig):
    """Qwen3-Next's in_proj_qkvz rows, [q_h | k_h | v_h | z_h] per key head h (v and z the
    value heads of that key head), as [q | k | v] and [z], each head-major."""
    hk, dk, dv = lin.num_key_heads, lin.key_head_dim, lin.value_head_dim
    rep = lin.num_value_heads // hk
    per_head = weight.view(hk, 2 * dk + 2 * rep * dv, weight.shape[-1])
    q, k, v, z = per_head.split([dk, dk, rep * dv, rep * dv], dim=1)
    flat = [x.reshape(-1, weight.shape[-1]) for x in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3].contiguous()


def split_ba(weight: torch.Tensor, lin: LinearAttentionConfig):
    """Qwen3-Next's in_proj_ba rows, [b_h | a_h] per key head, as [b] and [a]."""
    rep = lin.num_value_heads // lin.num_key_heads
    per_head = weight.view(lin.num_key_heads, 2 * rep, weight.shape[-1])
    b, a = per_head.split([rep, rep], dim=1)
    return b.reshape(-1, weight.shape[-1]), a.reshape(-1, weight.shape[-1])


for _architecture in (
    Architecture(
        "Qwen3NextForCausalLM",
        "qwen3_next",
        HybridForCausalLM,
        attention_bias=True,
        adapt_checkpoint=adapt_hybrid_checkpoint,
    ),
    Architecture(
        "Qwen3_5ForCausalLM",
        "qwen3_5_text",
        HybridForCausalLM,
        attention_bias=True,
        adapt_checkpoint=adapt_hybrid_checkpoint,
    ),
    Architecture(
        "Qwen3_5MoeForCausalLM",
        "qwen3_5_moe_text",
        HybridForCausalLM,
        attention_bias=True,
        adapt_checkpoint=adapt_hybrid_checkpoint,
    ),
):
    register_architecture(_architecture)

"""DeepSeek-V3 (and R1, and checkpoints that keep its architecture name): multi-head latent
attention and DeepSeek's mixture of experts, composed from engine/layers/.

- attention: engine/layers/latent_attention.py (q through a low-rank `q_lora_rank` with its
  norm, or straight; K and V from one cached latent of kv_lora_rank + qk_rope_head_dim per
  token; prefill expands it, decode absorbs the up-projections), YaRN with mscale in the
  softmax scale;
- feed-forward: `first_k_dense_replace` dense SwiGLU layers, then routed experts with a
  grouped sigmoid router and shared experts (engine/layers/grouped_moe.py);
- pre-norm residual layers as Llama's.

The same module serves Mistral 4 (engine/models/mistral4.py: softmax routing, queries scaled by
position). transformers' modeling_deepseek_v3.py is the reference for the math.

Checkpoints store each expert's projections as their own tensors (stacked at load, as for the
Qwen MoEs) and one multi-token-prediction layer past `num_hidden_layers` (DeepSeek-V3's
`model.layers.61.*`: `num_nextn_predict_layers`), which is dropped at load with a log line.
Variants this file does not run are refused by name (engine/model/architectures.py).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from kvbatch.engine.attention.metadata import AttentionMetadata, GroupedAttention, per_layer
from kvbatch.engine.layers.grouped_moe import GroupedMoeBlock
from kvbatch.engine.layers.latent_attention import LatentAttention
from kvbatch.engine.layers.logits import final_logits
from kvbatch.engine.layers.mlp import GatedMLP
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.layers.rotary import RotaryEmbedding
from kvbatch.engine.model.latent_attention import MlaFamily, read_mla_family
from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.models.llama import ModelConfig

log = logging.getLogger(__name__)


class MlaDecoderLayer(nn.Module):
    """Latent attention, then the dense MLP (first layers) or the experts; pre-norm, the
    residual add fused into each norm."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        family: MlaFamily = cfg.family
        self.self_attn = LatentAttention(cfg.hidden_size, family.attention)
        if layer >= family.first_dense_layers:
            self.mlp = GroupedMoeBlock(cfg.hidden_size, cfg.moe, family.routing)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rotation, kv_cache, meta, backend, query_scale):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        x = self.self_attn(h, rotation, kv_cache, meta, backend, query_scale)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual


class MlaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MlaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MlaForCausalLM(nn.Module):
    """Parameter names match Hugging Face's, so a checkpoint's state dict loads as it is (its
    experts stacked)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg.family, MlaFamily) or cfg.moe is None:
            raise ValueError(f"{cfg.architecture} needs its MLA and experts config")
        self.config = cfg
        self.model = MlaBackbone(cfg)
        self.rotary = RotaryEmbedding(cfg.family.rope)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def rebuild_rotary(self, device) -> None:
        self.rotary.rebuild(device)

    @property
    def output_embedding(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Mistral 4's factor on each query, 1 + beta * log(1 + floor(position / original))
        (transformers' get_llama_4_attn_scale); None for DeepSeek-V3."""
        attention = self.config.family.attention
        if not attention.query_scale_beta:
            return None
        steps = torch.floor(positions.float() / attention.query_scale_original)
        return (1 + attention.query_scale_beta * torch.log(1 + steps)).to(dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # one [1, blocks, block_size, 1, R + P] a layer
        meta: AttentionMetadata | GroupedAttention,
        backend,
        logits_indices: torch.Tensor | None = None,
        final_hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rotation = self.rotary(positions, x.dtype)
        query_scale = self.query_scale(positions, x.dtype)
        residual = None
        layers = self.model.layers
        for layer, kv_cache, layer_meta in zip(layers, kv_caches, per_layer(meta, len(layers))):
            x, residual = layer(x, residual, rotation, kv_cache, layer_meta, backend, query_scale)
        return final_logits(
            self.model.norm, x, residual, self.output_embedding, logits_indices, final_hidden
        )


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def drop_mtp_layers(state_dict: dict[str, torch.Tensor], cfg: ModelConfig):
    """The checkpoint without its multi-token-prediction layers (the `num_nextn_predict_layers`
    layers numbered from num_hidden_layers on): the decoder does not run them."""
    first, count = cfg.num_layers, cfg.family.mtp_layers
    mtp = [k for k in state_dict if (m := _LAYER.match(k)) and first <= int(m[1]) < first + count]
    if mtp:
        log.info(
            "%s: %d multi-token-prediction tensors (layers %d..%d) are not used",
            cfg.architecture,
            len(mtp),
            first,
            first + count - 1,
        )
        for k in mtp:
            del state_dict[k]
    return state_dict


register_architecture(
    Architecture(
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        MlaForCausalLM,
        attention_bias=True,
        adapt_checkpoint=drop_mtp_layers,
        read_family_config=read_mla_family,
    )
)

"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2, and the
mixture-of-experts Mixtral, Qwen2-MoE and Qwen3-MoE; Phi-3/4 in engine/models/phi3.py) composed
from engine/layers/, and the ModelConfig every architecture reads (Gemma's own layer is
engine/models/gemma.py).

It runs over a flat batch: every scheduled token of every sequence in one [num_tokens, hidden]
tensor, with positions per token, and attention reading and writing the paged KV cache. Only
the rows that will be sampled go through the vocabulary projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvbatch.engine.attention.layer_spec import LayerAttention
from kvbatch.engine.attention.metadata import AttentionMetadata, GroupedAttention, per_layer
from kvbatch.engine.layers.attention import SelfAttention
from kvbatch.engine.layers.logits import final_logits
from kvbatch.engine.layers.mlp import GatedMLP
from kvbatch.engine.layers.moe import SparseMoeBlock
from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.engine.layers.rotary import RotaryEmbedding
from kvbatch.engine.model.architectures import REFUSED_ARCHITECTURES, check_supported_features
from kvbatch.engine.model.linear_attention import LinearAttentionConfig
from kvbatch.engine.model.moe import MoeConfig
from kvbatch.engine.model.multimodal import TEXT_MODEL_OF
from kvbatch.engine.model.registry import (
    Architecture,
    architecture_named,
    register_architecture,
    supported_architectures,
)
from kvbatch.engine.model.rope import RopeConfig, rope_config_from_hf
from kvbatch.engine.models.gemma import GemmaConfig, global_rope_params


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family model; derived fields are filled in __post_init__."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    head_dim: int = 0  # 0: hidden_size // num_heads
    qkv_bias: bool = False
    o_bias: bool = False  # attention_bias of Llama / Qwen3: o_proj has a bias too
    mlp_bias: bool = False  # Llama's mlp_bias: gate, up and down have biases
    tie_word_embeddings: bool = False
    rope: RopeConfig | None = None
    sliding_window: int | None = None
    # "sliding_attention" or "full_attention" per layer (transformers' layer_types); empty:
    # every layer has the window when there is one (Mistral, Phi-3).
    layer_types: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    moe: MoeConfig | None = None  # the experts of mixture-of-experts models
    gemma: GemmaConfig | None = None  # Gemma 2 / 3 (engine/models/gemma.py)
    has_lm_head: bool = True  # False for a base model (Architecture.base_model): embeds only
    # the linear-attention layers of a hybrid model (engine/models/qwen3_next.py)
    linear: LinearAttentionConfig | None = None
    # An architecture's own settings (Architecture.read_family_config), read by its model file
    family: object | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.rope is None:
            object.__setattr__(self, "rope", RopeConfig(head_dim=self.head_dim))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV in the paged cache (a hybrid's linear layers keep states)."""
        return self.num_layers if self.linear is None else len(self.linear.full_layers)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) attends within the sliding window."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer `layer`'s attention variant: its window, and Gemma's scale and soft-cap."""
        window = self.sliding_window if self.is_sliding(layer) else None
        if self.gemma is not None:
            return self.gemma.layer_attention(window)
        return LayerAttention(sliding_window=window)

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head_dim) of layer `layer`'s cache: the model's, unless its family gives
        some layers another shape (Gemma 4's full-attention layers)."""
        shape = getattr(self.family, "kv_shape", None)
        return shape(layer) if shape is not None else (self.num_kv_heads, self.head_dim)

    def kv_planes(self, layer: int) -> int:
        """Tensors per token in layer `layer`'s cache: 2 (K and V), or 1 for a latent (MLA)
        layer, whose one vector stands for both (engine/model/latent_attention.py)."""
        return getattr(self.family, "kv_planes", 2)

    @property
    def is_latent(self) -> bool:
        """Whether the layers cache MLA latents rather than per-head K and V."""
        return self.kv_planes(0) == 1

    def keeps_kv(self, layer: int) -> bool:
        """Whether layer `layer` attends over the paged KV cache (a hybrid's linear layers keep
        a recurrent state instead)."""
        return self.linear is None or layer in self.linear.full_layers

    def kv_owner(self, layer: int) -> int:
        """The layer whose cache layer `layer` reads: itself, or for a KV-shared layer
        (Gemma 4) an earlier one; a layer that is not its own owner holds no KV."""
        owner = getattr(self.family, "kv_owner", None)
        return owner(layer) if owner is not None else layer

    @property
    def attention_break_even_context(self) -> int:
        """The context length at which one token's attention FLOPs (QK and PV: 4 x heads x
        head_dim per context token per layer) equal its matmul FLOPs (2 x a layer's weights):
        about 14.8k tokens for Llama-3.2-1B. Sizes long-prompt chunks (SchedulerConfig)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        ffn = self.moe.active_intermediate_size if self.moe else self.intermediate_size
        weights = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * ffn
        return max(1, round(weights / (2 * q)))

    @classmethod
    def from_hf(cls, hf_config) -> ModelConfig:
        """Read a transformers config; unsupported architectures are named in the error."""
        archs = list(getattr(hf_config, "architectures", None) or [])
        model_type = getattr(hf_config, "model_type", "")
        entry, has_lm_head = architecture_named(archs, model_type)
        refused = next((a for a in archs if a in REFUSED_ARCHITECTURES), None)
        if entry is None and refused is not None:
            raise ValueError(
                f"architecture {refused} is not supported: {REFUSED_ARCHITECTURES[refused]}"
            )
        if entry is None:
            found = ", ".join(archs) or model_type or "unknown"
            raise ValueError(
                f"architecture {found} is not supported; supported: "
                f"{', '.join(supported_architectures())}, and "
                f"the text model of {', '.join(TEXT_MODEL_OF)}"
            )
        check_supported_features(entry, hf_config)
        if entry.per_layer_shapes:  # transformers refuses the global values unless told
            hf_config.allow_global_per_layer_attribute_access = True
        arch = entry.name
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        sliding = getattr(hf_config, "sliding_window", None)
        if arch.startswith("Qwen") and not getattr(hf_config, "use_sliding_window", False):
            sliding = None
        switch = entry.sliding_window_switch
        if switch is not None and not getattr(hf_config, switch, False):
            sliding = None
        layer_types = tuple(getattr(hf_config, "layer_types", None) or ())
        if layer_types and "sliding_attention" not in layer_types:
            sliding = None
        fields = dict(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            # Qwen3.5-MoE has none: every layer's feed-forward is the experts
            intermediate_size=getattr(hf_config, "intermediate_size", 0),
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            max_position_embeddings=hf_config.max_position_embeddings,
            rms_norm_eps=hf_config.rms_norm_eps,
            head_dim=head_dim,
            qkv_bias=_has_qkv_bias(entry, hf_config),
            o_bias=entry.attention_bias and bool(getattr(hf_config, "attention_bias", False)),
            mlp_bias=entry.mlp_bias and bool(getattr(hf_config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            rope=rope_config_from_hf(hf_config, head_dim, global_rope_params(hf_config)),
            sliding_window=sliding,
            layer_types=layer_types if sliding else (),
            eos_token_ids=eos_ids,
            qk_norm=entry.qk_norm,
            moe=MoeConfig.from_hf(arch, hf_config),
            gemma=GemmaConfig.from_hf(arch, hf_config, head_dim),
            has_lm_head=has_lm_head,
            linear=LinearAttentionConfig.from_hf(arch, hf_config),
        )
        if entry.read_family_config is not None:
            fields["family"] = entry.read_family_config(hf_config, fields)
        return cls(**fields)


def _has_qkv_bias(architecture: Architecture, hf_config) -> bool:
    """q/k/v biases as transformers builds them: always for Qwen2, Qwen2-MoE's `qkv_bias`
    (default on), and `attention_bias` where the architecture reads it."""
    if architecture.name == "Qwen2ForCausalLM":
        return True
    if architecture.name == "Qwen2MoeForCausalLM":
        return bool(getattr(hf_config, "qkv_bias", True))
    return architecture.attention_bias and bool(getattr(hf_config, "attention_bias", False))


def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward block: the experts where the config puts them, else the
    SwiGLU MLP. Both sit at `mlp.*` (the loader maps Mixtral's `block_sparse_moe.*` there)."""
    if cfg.moe is not None and cfg.moe.is_sparse(layer):
        return SparseMoeBlock(cfg.hidden_size, cfg.moe)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, "silu", bias=cfg.mlp_bias)


class DecoderLayer(nn.Module):
    """Pre-norm attention and feed-forward; each norm adds the sublayer output before it to
    the residual stream (the first layer's input norm has nothing to add yet)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        head_norm = (lambda dim: RMSNorm(dim, cfg.rms_norm_eps)) if cfg.qk_norm else None
        self.self_attn = SelfAttention(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.layer_attention(layer),
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            head_norm=head_norm,
        )
        self.mlp = feed_forward(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rotation, kv_cache, meta, backend):
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        x = self.self_attn(h, rotation, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    """`model.*` in Hugging Face checkpoints: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match Hugging Face's, so a checkpoint's state dict loads as it is."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = RotaryEmbedding(cfg.rope)
        if not cfg.tie_word_embeddings and cfg.has_lm_head:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def rebuild_rotary(self, device) -> None:
        """RoPE buffers on `device` (the loader builds modules on the meta device)."""
        self.rotary.rebuild(device)

    @property
    def output_embedding(self) -> torch.Tensor:
        """The vocabulary projection; a base model has none and projects onto its input
        embeddings (its logits mean nothing: the engine refuses to generate with it)."""
        if self.config.tie_word_embeddings or not self.config.has_lm_head:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one [2, blocks, block_size, kv_heads, head_dim] a layer
        meta: AttentionMetadata | GroupedAttention,  # GroupedAttention: window groups
        backend,
        logits_indices: torch.Tensor | None = None,  # rows to project to the vocabulary
        final_hidden: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [len(logits_indices) or T, vocab] float32
        """`final_hidden`: when given, every row's state after the final norm ([T, hidden]) is
        appended to it, for pooling (engine/pooling/); the logits are unchanged."""
        x = self.model.embed_tokens(input_ids)  # this forward's own tensor: added to in place
        rotation = self.rotary(positions, x.dtype)
        residual = None
        layers = self.model.layers
        for layer, kv_cache, layer_meta in zip(layers, kv_caches, per_layer(meta, len(layers))):
            x, residual = layer(x, residual, rotation, kv_cache, layer_meta, backend)
        return final_logits(
            self.model.norm, x, residual, self.output_embedding, logits_indices, final_hidden
        )


# The names this file serves: Llama's layer, with the switches each family's config reads.
_QWEN3 = dict(qk_norm=True, attention_bias=True)
for _architecture in (
    Architecture(
        "LlamaForCausalLM",
        "llama",
        LlamaForCausalLM,
        "LlamaModel",
        attention_bias=True,
        mlp_bias=True,
    ),
    Architecture("MistralForCausalLM", "mistral", LlamaForCausalLM, "MistralModel"),
    Architecture("Qwen2ForCausalLM", "qwen2", LlamaForCausalLM, "Qwen2Model"),
    Architecture("Qwen3ForCausalLM", "qwen3", LlamaForCausalLM, "Qwen3Model", **_QWEN3),
    Architecture("MixtralForCausalLM", "mixtral", LlamaForCausalLM),
    Architecture("Qwen2MoeForCausalLM", "qwen2_moe", LlamaForCausalLM),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", LlamaForCausalLM, **_QWEN3),
):
    register_architecture(_architecture)

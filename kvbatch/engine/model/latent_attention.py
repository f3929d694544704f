"""The settings of a multi-head latent attention (MLA) family: DeepSeek-V3 (and R1, Kimi K2,
which keep its architecture name) and Mistral 4.

MLA caches one vector per token and layer instead of per-head K and V:

    latent = [ c_kv (kv_lora_rank, RMS-normed) | k_rope (qk_rope_head_dim, rotated) ]

from which kv_b_proj rebuilds every head's non-rotary key (qk_nope_head_dim) and value
(v_head_dim); the rotary key is shared by all heads (engine/layers/latent_attention.py). So a
layer's cache is one [1, blocks, block_size, 1, R + P] tensor (`kv_planes` 1, not K and V):
(R + P) x layers x dtype bytes per token, 1,152 bytes a layer for DeepSeek-V3 in bf16 against
32 KiB for its 128 heads' K and V.

The feed-forward is DeepSeek's mixture of experts (engine/layers/grouped_moe.py) after
`first_k_dense_replace` dense layers; `MlaFamily` carries both, as ModelConfig.family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbatch.engine.model.rope import RopeConfig, rope_config_from_hf


@dataclass(frozen=True)
class LatentAttentionConfig:
    """One MLA layer's shapes and its softmax scale."""

    num_heads: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int  # R: the cached latent's width
    qk_nope_head_dim: int  # N: per-head key/query part without RoPE
    qk_rope_head_dim: int  # P: the shared rotary key's width (and each query's rotary part)
    v_head_dim: int  # V
    scale: float  # (N + P) ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared
    rope_interleave: bool  # the rotary dims come as pairs (x0, x1), (x2, x3), ...
    attention_bias: bool = False  # biases on q_a_proj, kv_a_proj_with_mqa and o_proj
    # Mistral 4: queries times 1 + beta * log(1 + floor(position / original)) (Llama 4's
    # attention temperature tuning); beta 0: none
    query_scale_beta: float = 0.0
    query_scale_original: int = 1

    @property
    def latent_dim(self) -> int:
        """R + P: one token's cache entry."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's router (and Mistral 4's, with softmax and no bias): scores per expert,
    experts split into `num_groups` groups scored by the sum of their best two, the
    `topk_groups` best groups kept, the top k experts among them chosen by score (plus the
    correction bias, which changes the choice only), their weights the scores themselves,
    renormalised when asked, times `scaling`."""

    scoring: str  # "sigmoid" (DeepSeek-V3, in float32) or "softmax" (Mistral 4)
    num_groups: int
    topk_groups: int
    correction_bias: bool  # e_score_correction_bias (DeepSeek-V3)
    scaling: float  # routed_scaling_factor
    num_shared_experts: int  # a SwiGLU MLP of moe_intermediate_size x this, every token

    def __post_init__(self) -> None:
        if self.scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"unknown expert scoring {self.scoring!r}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"topk_group ({self.topk_groups}) must be between 1 and n_group ({self.num_groups})"
            )


@dataclass(frozen=True)
class MlaFamily:
    """ModelConfig.family of an MLA model: its attention, rotary and routing settings."""

    attention: LatentAttentionConfig
    rope: RopeConfig  # over qk_rope_head_dim
    routing: GroupedRouting
    first_dense_layers: int  # first_k_dense_replace
    mtp_layers: int = 0  # num_nextn_predict_layers: checkpoint layers past the model's, unused

    kv_planes = 1  # one latent tensor per layer, not K and V

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(1, R + P): the latent as a single KV head (MLA decode is MQA over the latent)."""
        return 1, self.attention.latent_dim


MLA_ARCHITECTURES = {"DeepseekV3ForCausalLM": "sigmoid", "Mistral4ForCausalLM": "softmax"}
"""The MLA architectures and their router's scoring."""


def read_mla_family(hf_config, fields: dict) -> MlaFamily:
    """The family settings of a DeepSeek-V3 or Mistral 4 config (Architecture's
    read_family_config)."""
    arch = fields["architecture"]
    scoring = MLA_ARCHITECTURES[arch]
    nope, rope_dim = int(hf_config.qk_nope_head_dim), int(hf_config.qk_rope_head_dim)
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    # the rotary part is exactly qk_rope_head_dim (Mistral 4 says it as a partial factor of
    # nope + rope, DeepSeek as head_dim = rope): read it so, whatever the float product gives
    rope = rope_config_from_hf(hf_config, rope_dim, {**params, "partial_rotary_factor": 1.0})
    beta = 0.0
    if arch == "Mistral4ForCausalLM":
        beta = float(params.get("llama_4_scaling_beta") or 0.0)
    attention = LatentAttentionConfig(
        num_heads=int(hf_config.num_attention_heads),
        q_lora_rank=getattr(hf_config, "q_lora_rank", None) or None,
        kv_lora_rank=int(hf_config.kv_lora_rank),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf_config.v_head_dim),
        scale=softmax_scale(params, nope + rope_dim),
        rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
        attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        query_scale_beta=beta,
        query_scale_original=int(params.get("original_max_position_embeddings") or 1),
    )
    routing = GroupedRouting(
        scoring=scoring,
        num_groups=int(getattr(hf_config, "n_group", None) or 1),
        topk_groups=int(getattr(hf_config, "topk_group", None) or 1),
        correction_bias=scoring == "sigmoid",
        scaling=float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0),
        num_shared_experts=int(getattr(hf_config, "n_shared_experts", 0) or 0),
    )
    first_dense = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    mtp = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
    return MlaFamily(attention, rope, routing, first_dense, mtp)


def softmax_scale(rope_parameters: dict, qk_head_dim: int) -> float:
    """(N + P) ** -0.5, times YaRN's mscale squared where the config scales all dimensions
    (`mscale_all_dim`), as transformers' yarn_apply_mscale and DeepSeek's reference do."""
    scale = qk_head_dim**-0.5
    rope_type = rope_parameters.get("rope_type") or rope_parameters.get("type") or "default"
    mscale_all_dim = rope_parameters.get("mscale_all_dim") or 0
    if rope_type != "default" and mscale_all_dim:
        factor = float(rope_parameters["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale

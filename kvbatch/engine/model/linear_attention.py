"""The linear-attention layers of a hybrid model (Qwen3-Next, Qwen3.5 dense and MoE): which
layers they are, and the shape of their Gated DeltaNet (engine/layers/gated_delta_net.py).

config.json's `layer_types` names each layer `linear_attention` or `full_attention`; a linear
layer keeps no KV cache but a fixed-size state per sequence (engine/kv/state_slots.py):
a conv state of the last kernel - 1 inputs of q, k and v, and a recurrent state of
[key_head_dim, value_head_dim] per value head. Any other layer type fails at load, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

LINEAR, FULL = "linear_attention", "full_attention"

HYBRID_LINEAR_ARCHITECTURES = {
    "Qwen3NextForCausalLM": True,  # fused in_proj_qkvz / in_proj_ba, laid out per key head
    "Qwen3_5ForCausalLM": False,
    "Qwen3_5MoeForCausalLM": False,
}
"""Hybrid architectures, and whether their projections are Qwen3-Next's fused ones."""


@dataclass(frozen=True)
class LinearAttentionConfig:
    layer_types: tuple[str, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    fused_projections: bool  # Qwen3-Next's checkpoint layout (split at load)

    def __post_init__(self) -> None:
        unknown = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if unknown:
            raise ValueError(
                f"layer_types has {', '.join(map(repr, unknown))}, which is not a layer type "
                f"of this architecture: each layer is {LINEAR!r} or {FULL!r}"
            )
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_key_heads})"
            )
        if self.conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim must be 1 or more, got {self.conv_kernel}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @classmethod
    def from_hf(cls, architecture: str, hf_config) -> LinearAttentionConfig | None:
        """The linear layers of a hybrid config; None for other architectures."""
        if architecture not in HYBRID_LINEAR_ARCHITECTURES:
            return None
        types = tuple(getattr(hf_config, "layer_types", None) or ())
        if len(types) != hf_config.num_hidden_layers:
            raise ValueError(
                f"layer_types names {len(types)} layers but num_hidden_layers is "
                f"{hf_config.num_hidden_layers}"
            )
        return cls(
            layer_types=types,
            num_key_heads=hf_config.linear_num_key_heads,
            num_value_heads=hf_config.linear_num_value_heads,
            key_head_dim=hf_config.linear_key_head_dim,
            value_head_dim=hf_config.linear_value_head_dim,
            conv_kernel=hf_config.linear_conv_kernel_dim,
            fused_projections=HYBRID_LINEAR_ARCHITECTURES[architecture],
        )

"""SmolLM3: Llama's layer (engine/models/llama.py) with NoPE layers.

Every `no_rope_layer_interval`-th layer (by default the 4th, 8th, ...) applies no rotary
embedding: its queries and keys carry no position, and attention there is order-blind apart
from the causal mask. transformers' config lists the layers as `no_rope_layers` with the
opposite meaning of its name: `no_rope_layers[i] == 1` means layer i USES RoPE
(SmolLM3Attention.use_rope = config.no_rope_layers[layer_idx]).

A sliding window applies only where `use_sliding_window` is set (the published checkpoints
have none). The chat template's reasoning switch (`/think`, `/no_think`, `enable_thinking`)
belongs to the reasoning-output parsers, not to the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbatch.engine.attention.metadata import AttentionMetadata, GroupedAttention, per_layer
from kvbatch.engine.layers.logits import final_logits
from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class SmolLM3Config:
    """Which layers rotate their queries and keys (the others are NoPE layers)."""

    uses_rope: tuple[bool, ...]

    @classmethod
    def from_hf(cls, hf_config, fields: dict) -> SmolLM3Config:
        flags = getattr(hf_config, "no_rope_layers", None)
        num_layers = fields["num_layers"]
        if flags is None:  # transformers' default, for a config.json without the list
            interval = getattr(hf_config, "no_rope_layer_interval", 4)
            flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if len(flags) != num_layers:
            raise ValueError(
                f"SmolLM3 config has {len(flags)} no_rope_layers entries for "
                f"{num_layers} layers (num_hidden_layers): one 0/1 per layer, 1 = uses RoPE"
            )
        return cls(uses_rope=tuple(bool(f) for f in flags))


def no_rotation(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A NoPE layer's 'rotation': queries and keys as they are."""
    return q, k


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose NoPE layers get no rotation; weights and names are Llama's."""

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
        rotation = self.rotary(positions, x.dtype)
        uses_rope = self.config.family.uses_rope
        residual = None
        layers = self.model.layers
        metas = per_layer(meta, len(layers))
        for i, (layer, kv_cache, layer_meta) in enumerate(zip(layers, kv_caches, metas)):
            turn = rotation if uses_rope[i] else no_rotation
            x, residual = layer(x, residual, turn, kv_cache, layer_meta, backend)
        return final_logits(
            self.model.norm, x, residual, self.output_embedding, logits_indices, final_hidden
        )


register_architecture(
    Architecture(
        "SmolLM3ForCausalLM",
        "smollm3",
        SmolLM3ForCausalLM,
        "SmolLM3Model",
        attention_bias=True,
        mlp_bias=True,
        sliding_window_switch="use_sliding_window",
        read_family_config=SmolLM3Config.from_hf,
    )
)

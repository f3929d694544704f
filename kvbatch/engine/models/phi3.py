"""Phi-3 and Phi-4: Llama's layer with fused projections on disk. The smallest architecture
file, and the example of adding one (docs/ENGINE.md): it names the model class to build, the
config switches that class reads, and how the checkpoint's tensors map onto its modules.

A Phi-3 checkpoint stores each layer's q, k and v as one `qkv_proj` ([q; k; v] rows) and gate
and up as one `gate_up_proj` ([gate; up] rows). The engine's modules keep Llama's separate
projections under the names other checkpoints and the quantization configs use, so the tensors
are split at load; engine/layers/linear.py merges them again, as views, for one GEMM each.
Everything else of Phi-3 (LongRoPE, a partial rotary factor, sliding windows) is configuration
the Llama layers read.
"""

from __future__ import annotations

import torch

from kvbatch.engine.model.registry import Architecture, register_architecture
from kvbatch.engine.models.llama import LlamaForCausalLM, ModelConfig


def llama_names(state_dict: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under Llama's module names."""
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return split_fused_projections(state_dict, q_size, kv_size, cfg.intermediate_size)


register_architecture(
    Architecture("Phi3ForCausalLM", "phi3", LlamaForCausalLM, adapt_checkpoint=llama_names)
)


def split_fused_projections(
    state_dict: dict[str, torch.Tensor], q_size: int, kv_size: int, intermediate_size: int
) -> dict[str, torch.Tensor]:
    """Replace `*.qkv_proj.weight` by q/k/v_proj and `*.gate_up_proj.weight` by gate/up_proj.

    Sizes are output rows: q_size = heads x head_dim, kv_size = kv_heads x head_dim. A tensor
    whose rows do not add up fails naming the layer (a config that does not fit its weights).
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".qkv_proj") and leaf == "weight":
            base = prefix.removesuffix(".qkv_proj")
            parts = _split(name, tensor, (q_size, kv_size, kv_size))
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[f"{base}.{proj}.weight"] = part
        elif prefix.endswith(".gate_up_proj") and leaf == "weight" and tensor.dim() == 2:
            base = prefix.removesuffix(".gate_up_proj")
            gate, up = _split(name, tensor, (intermediate_size, intermediate_size))
            out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = gate, up
        else:
            out[name] = tensor
    return out


def _split(name: str, tensor: torch.Tensor, rows: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    if tensor.shape[0] != sum(rows):
        raise ValueError(
            f"{name} has {tensor.shape[0]} rows; the config's heads and sizes need "
            f"{' + '.join(map(str, rows))} = {sum(rows)} (is config.json this checkpoint's?)"
        )
    return tuple(t.contiguous() for t in torch.split(tensor, list(rows)))

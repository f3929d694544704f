"""Tiny random mixture-of-experts checkpoints quantized and compressed by compressed-tensors.

transformers holds a model's experts as two stacked tensors, which compressed-tensors (it
quantizes nn.Linear modules) cannot see. llm-compressor, the tool that writes the quantized
MoE checkpoints teams download, swaps in one nn.Linear per expert and projection before it
quantizes; the checkpoints it saves therefore name every expert's projection on its own
(`mlp.experts.3.gate_proj.weight_packed`, Mixtral's `experts.3.w1`). `LinearizedExperts` does
that swap here, with the forward of transformers' experts, and ct_checkpoints.quantize_and_save
calibrates, compresses and saves as for the dense models.

The reference is the same model before compression, in compressed-tensors' frozen state: each
Linear fake-quantizes its weight and (for W8A8 schemes) its input on every forward, the
library's own definition of what the quantized model computes. transformers cannot load these
files itself (its experts are not Linear modules), so the engine's answers from the files on
disk are compared with that.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig

from tests.engine.quant.ct_checkpoints import quantize_and_save
from tests.tiny_models import BOS, EOS, randomize_weights, tiny_config

# The projections' names in checkpoints: (gate, up, down).
PROJECTIONS = {
    "qwen3-moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2-moe": ("gate_proj", "up_proj", "down_proj"),
    "mixtral": ("w1", "w3", "w2"),
}
# Kept in float, as llm-compressor's MoE recipes do: the output head, the routers (nn.Linear
# only in the Qwen2-MoE shared expert's gate; transformers' routers are not Linear modules).
IGNORE = ("lm_head", "re:.*shared_expert_gate$")


class ExpertMLP(nn.Module):
    """One expert's SwiGLU projections as nn.Linear modules, under the checkpoint's names."""

    def __init__(self, names: tuple[str, str, str], hidden: int, inter: int) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False))
        setattr(self, up, nn.Linear(hidden, inter, bias=False))
        setattr(self, down, nn.Linear(inter, hidden, bias=False))

    def forward(self, x: torch.Tensor, act) -> torch.Tensor:
        """x [n, H] runs as one sequence [1, n, H]: compressed-tensors quantizes activations
        "per token" over the last dimension of 3-D inputs only (a 2-D input gets one scale for
        all its rows), and dense layers see [batch, tokens, H]."""
        gate, up, down = (getattr(self, n) for n in self.names)
        x = x[None]
        return down(act(gate(x)) * up(x))[0]


class LinearizedExperts(nn.Module):
    """A drop-in for transformers' stacked experts (same forward signature and arithmetic)
    holding one ExpertMLP per expert, so each projection is a Linear compressed-tensors can
    quantize."""

    def __init__(self, stacked: nn.Module, names: tuple[str, str, str]) -> None:
        num_experts, two_inter, hidden = stacked.gate_up_proj.shape
        inter = two_inter // 2
        super().__init__()
        self.experts = [ExpertMLP(names, hidden, inter) for _ in range(num_experts)]
        for e, expert in enumerate(self.experts):
            self.add_module(str(e), expert)  # named "<e>", as in the checkpoints
        self.act_fn = stacked.act_fn
        gate, up, down = names
        with torch.no_grad():
            for e, expert in enumerate(self.experts):
                getattr(expert, gate).weight.copy_(stacked.gate_up_proj[e, :inter])
                getattr(expert, up).weight.copy_(stacked.gate_up_proj[e, inter:])
                getattr(expert, down).weight.copy_(stacked.down_proj[e])

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            y = expert(hidden_states[token_idx], self.act_fn)
            out.index_add_(0, token_idx, y * top_k_weights[token_idx, slot, None])
        return out


def linearize_experts(model: nn.Module, kind: str) -> nn.Module:
    """Replace every stacked-experts module of `model` by LinearizedExperts, in place."""
    for name, module in list(model.named_modules()):
        if name.endswith(".experts") and hasattr(module, "gate_up_proj"):
            parent, _, child = name.rpartition(".")
            setattr(
                model.get_submodule(parent), child, LinearizedExperts(module, PROJECTIONS[kind])
            )
    return model


def linearized_moe_model(kind: str, seed: int = 0) -> nn.Module:
    """A tiny random `kind` MoE model in float32 with one nn.Linear per expert projection.
    Every K is a multiple of the quantization groups (32)."""
    config = tiny_config(kind)
    if hasattr(config, "moe_intermediate_size"):  # the down projections' K
        config.moe_intermediate_size = 64
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    return linearize_experts(model, kind)


def build_moe_ct_checkpoint(
    kind: str, scheme: str, path: Path, seed: int = 0, more_groups: dict | None = None
):
    """Save a tiny random `kind` MoE model quantized with `scheme` (ct_checkpoints.SCHEMES,
    plus `more_groups` {scheme: targets}) as compressed-tensors writes it; returns (path,
    reference model)."""
    model = linearized_moe_model(kind, seed)
    holder: dict[str, nn.Module] = {}

    def keep_reference(frozen: nn.Module) -> None:
        holder["reference"] = copy.deepcopy(frozen).eval()

    quantize_and_save(model, scheme, path, seed, IGNORE, keep_reference, more_groups=more_groups)
    return Path(path), holder["reference"]


def save_float_moe(kind: str, path: Path, seed: int = 0) -> Path:
    """The float model build_moe_ct_checkpoint(kind, ..., seed) starts from, saved with one
    tensor per expert projection (as original MoE checkpoints on the Hub are)."""
    linearized_moe_model(kind, seed).save_pretrained(path)
    return Path(path)

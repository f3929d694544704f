"""The gated MLP: down(act(gate(x)) * up(x)), gate and up as one merged GEMM.

SwiGLU (activation "silu": the Llama family, MoE shared experts) and GeGLU ("gelu_tanh":
Gemma). The modules keep the checkpoint's names (gate_proj, up_proj, down_proj)."""

from __future__ import annotations

import torch
from torch import nn

from kvbatch.engine.layers.activation import ACTIVATIONS
from kvbatch.engine.layers.linear import MergedLinear


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_proj = MergedLinear("gate_proj", "up_proj")
        self.act_and_mul = ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

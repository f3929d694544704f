"""The gated activations, over a merged [T, 2F] gate|up output: act(gate) * up -> [T, F].

SwiGLU's SiLU (Llama family) and GeGLU's tanh-approximate GELU (Gemma). The Triton path is one
elementwise kernel (kernels/activation.py) reading both halves in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbatch.engine.layers.kernel_op import KernelOp
from kvbatch.kernels.activation import gelu_tanh_and_mul, silu_and_mul


class SiluAndMul(KernelOp):
    def forward_torch(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_triton(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return silu_and_mul(gate, up)


class GeluTanhAndMul(KernelOp):
    def forward_torch(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward_triton(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return gelu_tanh_and_mul(gate, up)


ACTIVATIONS = {"silu": SiluAndMul, "gelu_tanh": GeluTanhAndMul}

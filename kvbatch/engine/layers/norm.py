"""RMSNorm, with the residual add of the sublayer before it fused in.

    h = norm(x)                       the first layer's input norm, and norms of a sublayer's
                                      own output (Gemma's post-norms, q/k head norms)
    h, residual = norm(x, residual)   residual += x, then h = norm(residual): one pass over
                                      the row in the Triton kernel (kernels/rms_norm.py)

The torch path normalises in float32 and casts back before the weight (transformers' Llama);
`unit_offset` is Gemma's form, (1 + w) in float32 before the cast. The residual sum is rounded
to its dtype as `residual + x` is, so both paths hold the same residual stream.
"""

from __future__ import annotations

import torch
from torch import nn

from kvbatch.engine.layers.kernel_op import KernelOp
from kvbatch.kernels.rms_norm import fused_add_rms_norm, rms_norm


class RMSNorm(KernelOp):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        # Gemma stores w around zero (the norm multiplies by 1 + w), Llama around one
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward_torch(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual += x  # the caller's residual stream, never a weight or an input
        return self._norm(residual), residual

    def forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            return fused_add_rms_norm(
                x, residual, self.weight, self.eps, unit_offset=self.unit_offset
            )
        rows = x.reshape(-1, x.shape[-1])  # q/k head norms: one kernel row per head
        out = rms_norm(rows, self.weight, self.eps, unit_offset=self.unit_offset)
        return out.view(x.shape)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

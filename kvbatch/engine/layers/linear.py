"""Projections of one input that run as one GEMM: q/k/v, and an MLP's gate/up.

An architecture keeps the checkpoint's own modules (`q_proj`, `k_proj`, `v_proj`: state-dict
names as Hugging Face writes them, so float, quantized and GGUF checkpoints load unchanged) and
names the group beside them:

    self.qkv_proj = MergedLinear("q_proj", "k_proj", "v_proj")

At load (merge_projections, which the loader calls for every model) the float weights are
concatenated into one [sum(out), in] tensor and the modules' parameters become views into it:
one larger GEMM per group (a decode step is launch- and bandwidth-bound), no memory doubled,
the state dict unchanged. Quantized projections (engine/quant) stay apart: each runs its own
GEMM and their outputs are concatenated, so the architecture reads the same merged output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MergedLinear(nn.Module):
    """The concatenated output [T, sum(out)] of its owner's projections `names`, in order.
    Holds no parameters of its own: the merged weight is not in the state dict."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = names
        self.parts: tuple[nn.Module, ...] = ()  # a tuple: not registered twice as children
        self.weight: torch.Tensor | None = None  # [sum(out), in] when every part is float
        self.bias: torch.Tensor | None = None

    def merge(self, parts: list[nn.Module]) -> None:
        """Take the owner's projections; float ones become views into one merged weight."""
        self.parts = tuple(parts)
        if any(type(part) is not nn.Linear for part in parts):
            self.weight = self.bias = None
            return
        self.weight = _concat_rows([part.weight for part in parts])
        if parts[0].bias is not None:
            self.bias = _concat_rows([part.bias for part in parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(out)]
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        if not self.parts:
            raise RuntimeError(
                f"{'/'.join(self.names)} are not merged yet: call "
                "kvbatch.engine.layers.linear.merge_projections(model) after loading weights"
            )
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"{'+'.join(self.names)}, merged={self.weight is not None}"


def _concat_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """One tensor of the parameters' rows; each parameter becomes a view into it."""
    merged = torch.cat([p.data for p in params])
    row = 0
    for p in params:
        n = p.shape[0]
        p.data = merged[row : row + n]
        row += n
    return merged


def merge_projections(model: nn.Module) -> nn.Module:
    """Merge every MergedLinear's projections of `model` (after its weights are loaded, and
    after quantized layers took their places). Returns the model."""
    for owner in model.modules():
        for child in owner.children():
            if isinstance(child, MergedLinear):
                child.merge([getattr(owner, name) for name in child.names])
    return model

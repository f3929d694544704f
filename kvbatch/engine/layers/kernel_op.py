"""One layer, two kernels: the plain-torch path and the Triton path, chosen by the backend.

A KernelOp runs `forward_torch` until `use_kernels(model, "triton")` points it at
`forward_triton` (the engine does this once, with the triton attention backend). An
architecture calls the layer and never names a kernel, so it is written once for both.
"""

from __future__ import annotations

from typing import Literal, get_args

from torch import nn

from kvbatch.engine.quant.linear import use_gemm_backend

KernelBackend = Literal["torch", "triton"]


class KernelOp(nn.Module):
    """A layer with a plain-torch and a Triton implementation of the same arithmetic."""

    backend: KernelBackend = "torch"

    def forward(self, *args, **kwargs):
        if self.backend == "triton":
            return self.forward_triton(*args, **kwargs)
        return self.forward_torch(*args, **kwargs)

    def forward_torch(self, *args, **kwargs):
        raise NotImplementedError

    def forward_triton(self, *args, **kwargs):
        raise NotImplementedError


def use_kernels(model: nn.Module, backend: str) -> nn.Module:
    """Run every layer of `model` (KernelOps and quantized linears) on `backend`'s kernels:
    "torch" (plain torch, any device) or "triton" (kvbatch.kernels). Returns the model."""
    if backend not in get_args(KernelBackend):
        raise ValueError(
            f"unknown kernel backend {backend!r}; use one of {get_args(KernelBackend)}"
        )
    for module in model.modules():
        if isinstance(module, KernelOp):
            module.backend = backend
    use_gemm_backend(model, backend)
    return model

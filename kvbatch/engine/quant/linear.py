"""The quantized stand-ins for nn.Linear, one per scheme. Each holds its canonical tensors as
buffers (under the checkpoint's own names where it has them, so `weight` stays `weight`) and
calls its GEMM in gemm.py. Off CUDA a layer keeps a float copy of its dequantized weight,
made once at load: the CPU path is a float matmul that gives the quantized layer's answers.
`backend` picks gemm.py's path ("torch", or "triton" for kvbatch.kernels' GEMMs); the engine
sets it once, with the attention backend (use_gemm_backend)."""

from __future__ import annotations

import torch
from torch import nn

from kvbatch.engine.quant import gemm
from kvbatch.engine.quant.qdq import dequantize_blocks, dequantize_scaled
from kvbatch.engine.quant.wna16_layout import WNA16Weights


class QuantLinear(nn.Module):
    """Common to the quantized linears: shape, optional float bias, the CPU's float weight."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.float_weight: torch.Tensor | None = None  # not a buffer: not in the state dict
        self.backend: gemm.GemmBackend = "torch"

    def prepare(self, dtype: torch.dtype) -> None:
        """Make the float weight the CPU path multiplies by (a no-op on CUDA)."""
        if not self._on_cuda():
            self.float_weight = self.dequantize(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [N, K] this layer stands for."""
        raise NotImplementedError

    def use_backend(self, backend: str) -> None:
        """Run gemm.py's `backend` path from now on ("torch" or "triton")."""
        self.backend = gemm.check_backend(backend)

    def _on_cuda(self) -> bool:
        return next(self.buffers()).is_cuda

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Fp8Linear(QuantLinear):
    """FP8 weights [N, K] with per-channel ([N, 1]) or per-tensor ([1, 1]) float32 scales;
    activations quantized per token, or with the static `input_scale` [1, 1]."""

    def __init__(self, weight, weight_scale, input_scale, bias) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("input_scale", input_scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_scaled(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.fp8_linear(
            x,
            self.weight,
            self.weight_scale,
            self.input_scale,
            self.bias,
            self.float_weight,
            self.backend,
        )


class Fp8BlockLinear(QuantLinear):
    """FP8 weights [N, K] with a float32 scale per [block_n, block_k] tile, `weight_scale`
    [ceil(N / block_n), ceil(K / block_k)]; activations quantized per token and group of
    block_k along K."""

    def __init__(self, weight, weight_scale, block: tuple[int, int], bias) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.block = tuple(block)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.weight, self.weight_scale, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.fp8_block_linear(
            x,
            self.weight,
            self.weight_scale,
            self.block,
            self.bias,
            self.float_weight,
            self.backend,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={list(self.block)}"


class Int8Linear(QuantLinear):
    """int8 weights [N, K] with float32 per-channel scales [N, 1]; activations quantized
    symmetrically per token."""

    def __init__(self, weight, weight_scale, bias) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_scaled(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.int8_linear(
            x, self.weight, self.weight_scale, self.bias, self.float_weight, self.backend
        )


class WNA16Linear(QuantLinear):
    """4/8-bit integer weights in the canonical layout (wna16_layout.py), float activations."""

    def __init__(self, weights: WNA16Weights, bias) -> None:
        super().__init__(weights.in_features, weights.out_features, bias)
        self.group_size, self.bits = weights.group_size, weights.bits
        self.register_buffer("qweight", weights.qweight)
        self.register_buffer("scales", weights.scales)
        self.register_buffer("zeros", weights.zeros)
        self.register_buffer("g_idx", weights.g_idx)

    @property
    def weights(self) -> WNA16Weights:
        return WNA16Weights(
            self.qweight, self.scales, self.zeros, self.g_idx, self.group_size, self.bits
        )

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weights.dequantize().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.wna16_linear(x, self.weights, self.bias, self.float_weight, self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, group_size={self.group_size}"


def use_gemm_backend(model: nn.Module, backend: str) -> int:
    """Point every quantized linear of `model` at gemm.py's `backend`; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for layer in layers:
        layer.use_backend(backend)
    return len(layers)

"""One GEMM per scheme: the single place where a quantized layer's matmul is chosen.

Each function takes the activations x [..., K] and a layer's canonical tensors and returns
[..., N] in x's dtype. Two backends, set per layer by the engine (QuantLinear.backend):

- "torch" (the CPU, and CUDA with the torch attention backend): the layer's dequantized float
  weight (computed once off CUDA, `float_weight`; per call on CUDA) runs an ordinary matmul
  after the activations go through the same quantization round trip, so the answers follow
  the quantized model exactly. On CUDA torch._scaled_mm (FP8, sm_89+) and torch._int_mm
  (int8) serve where their shape rules allow.
- "triton" (set with the triton attention backend; on the CPU under TRITON_INTERPRET=1 for
  tests): kvbatch.kernels' GEMMs. FP8 and int8 activations are quantized by a kernel
  (per token, or with the checkpoint's static scale), then multiplied in FP8 or int8 with the
  scales applied once; block-scaled FP8 quantizes per token and group of block_k and scales
  each K block's partial sum (kernels/fp8_block_gemm.py); W4A16/W8A16 weights are dequantized in registers by wna16_gemm up to
  WNA16_KERNEL_MAX_BATCH rows, and dequantized whole then multiplied by cuBLAS above it
  (a large batch is compute-bound, where cuBLAS's bf16 GEMM is the faster one).

Every choice depends on shapes and dtypes only, never on values, and nothing reads back to
the host: a decode step captured in a CUDA graph replays the same kernels.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from kvbatch.engine.quant.qdq import (
    FP8_MAX,
    absmax_scale,
    dequantize_blocks,
    dequantize_scaled,
    fake_quantize_fp8,
    fake_quantize_fp8_per_group,
    fake_quantize_int8_per_token,
    quantize_fp8,
    quantize_int8_per_token,
)
from kvbatch.engine.quant.wna16_layout import WNA16Weights
from kvbatch.kernels import fp8_block_gemm, fp8_gemm, int8_gemm
from kvbatch.kernels.fp8_block_gemm import kernel_serves_block_k
from kvbatch.kernels.wna16_gemm import wna16_gemm

GemmBackend = Literal["torch", "triton"]
GEMM_BACKENDS: tuple[str, ...] = ("torch", "triton")

# Rows (tokens in the step) up to which the W4A16 kernel runs; above it the weight is
# dequantized and cuBLAS multiplies. Unmeasured default: the crossover is to be set from
# scripts/quant_gemm_bench.py on the GPU, whose last line gives it (docs/BENCHMARKS.md).
WNA16_KERNEL_MAX_BATCH = 64


def fp8_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor,  # float32 [N, 1] or [1, 1]
    input_scale: torch.Tensor | None,  # float32 [1, 1] (static) or None (per token)
    bias: torch.Tensor | None,
    float_weight: torch.Tensor | None,  # the dequantized weight, off CUDA
    backend: GemmBackend = "torch",
) -> torch.Tensor:
    """FP8 W8A8: x quantized per token (or with the static input_scale), times the FP8 weight,
    both scales applied once, + bias."""
    if backend == "triton":
        return _on_rows(x, lambda rows: _fp8_kernels(rows, weight, weight_scale, input_scale, bias))
    if _scaled_mm_serves(x, weight):
        return _on_rows(
            x, lambda rows: _fp8_scaled_mm(rows, weight, weight_scale, input_scale, bias)
        )
    if float_weight is None:  # CUDA where _scaled_mm does not serve: dequantize per call
        float_weight = dequantize_scaled(weight, weight_scale, x.dtype)
    return F.linear(fake_quantize_fp8(x, input_scale), float_weight, bias)


def fp8_block_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor,  # float32 [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int],  # (bn, bk)
    bias: torch.Tensor | None,
    float_weight: torch.Tensor | None,  # the dequantized weight, off CUDA
    backend: GemmBackend = "torch",
) -> torch.Tensor:
    """Block-scaled FP8 W8A8: x quantized per token and group of bk, times the FP8 weight, each
    K block's sum scaled by its activation and weight scales, + bias."""
    if backend == "triton" and kernel_serves_block_k(block[1]):
        return _on_rows(x, lambda rows: _fp8_block_kernels(rows, weight, weight_scale, block, bias))
    if float_weight is None:  # on CUDA: dequantize per call
        float_weight = dequantize_blocks(weight, weight_scale, block, x.dtype)
    return F.linear(fake_quantize_fp8_per_group(x, block[1]), float_weight, bias)


def int8_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # int8 [N, K]
    weight_scale: torch.Tensor,  # float32 [N, 1]
    bias: torch.Tensor | None,
    float_weight: torch.Tensor | None,
    backend: GemmBackend = "torch",
) -> torch.Tensor:
    """INT8 W8A8: x quantized symmetrically per token (compressed-tensors' convention), times
    the int8 weight, both scales applied once, + bias."""
    if backend == "triton":
        return _on_rows(x, lambda rows: _int8_kernels(rows, weight, weight_scale, bias))
    if (
        x.is_cuda
        and x.shape[-1] % 8 == 0
        and weight.shape[0] % 8 == 0
        and x.numel() > 16 * x.shape[-1]
    ):
        return _on_rows(x, lambda rows: _int_mm(rows, weight, weight_scale, bias))
    if float_weight is None:  # CUDA below _int_mm's sizes: dequantize per call
        float_weight = dequantize_scaled(weight, weight_scale, x.dtype)
    return F.linear(fake_quantize_int8_per_token(x), float_weight, bias)


def wna16_linear(
    x: torch.Tensor,  # [..., K]
    weights: WNA16Weights,
    bias: torch.Tensor | None,
    float_weight: torch.Tensor | None,
    backend: GemmBackend = "torch",
) -> torch.Tensor:
    """Weight-only 4/8-bit: x times the dequantized weight (in registers by the kernel for small
    batches, whole for large ones), + bias."""
    if backend == "triton" and x.numel() <= WNA16_KERNEL_MAX_BATCH * x.shape[-1]:
        return _on_rows(x, lambda rows: _wna16_kernel(rows, weights, bias))
    if float_weight is None:  # on the GPU above the kernel's batches: dequantize per call
        float_weight = weights.dequantize().to(x.dtype)
    return F.linear(x, float_weight, bias)


def check_backend(backend: str) -> GemmBackend:
    """`backend` if it is one of GEMM_BACKENDS, else a ValueError naming them."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"quantized GEMM backend {backend!r}: choose one of {GEMM_BACKENDS}")
    return backend  # type: ignore[return-value]


def _on_rows(x: torch.Tensor, gemm_2d) -> torch.Tensor:
    """Run a [M, K] -> [M, N] GEMM on x [..., K], giving [..., N]."""
    out = gemm_2d(x.reshape(-1, x.shape[-1]))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _fp8_kernels(x, weight, weight_scale, input_scale, bias) -> torch.Tensor:
    if input_scale is None:
        x_fp8, x_scale = fp8_gemm.quantize_fp8_per_token(x)  # scale [M, 1]
    else:
        x_fp8, x_scale = fp8_gemm.quantize_fp8_static(x, input_scale), input_scale.reshape(1, 1)
    return fp8_gemm.fp8_scaled_mm(x_fp8, x_scale, weight, weight_scale, x.dtype, bias)


def _fp8_block_kernels(x, weight, weight_scale, block, bias) -> torch.Tensor:
    x_fp8, x_scale = fp8_block_gemm.quantize_fp8_per_token_group(x, block[1])  # [M, K / bk]
    return fp8_block_gemm.fp8_block_scaled_mm(
        x_fp8, x_scale, weight, weight_scale, block, x.dtype, bias
    )


def _int8_kernels(x, weight, weight_scale, bias) -> torch.Tensor:
    x_int8, x_scale = int8_gemm.quantize_int8_per_token(x)
    return int8_gemm.int8_scaled_mm(x_int8, x_scale, weight, weight_scale, x.dtype, bias)


def _wna16_kernel(x, weights: WNA16Weights, bias) -> torch.Tensor:
    w = weights
    out = wna16_gemm(x, w.qweight, w.scales, w.zeros, w.g_idx, w.group_size, w.bits)
    return out if bias is None else out + bias


def _fp8_scaled_mm(x, weight, weight_scale, input_scale, bias) -> torch.Tensor:
    if input_scale is None:
        x_scale = absmax_scale(x, FP8_MAX, dim=-1)  # [M, 1]
    else:
        x_scale = input_scale.expand(x.shape[0], 1).contiguous()
    w_scale = weight_scale.expand(weight.shape[0], 1).t().contiguous()  # [1, N]
    out = torch._scaled_mm(
        quantize_fp8(x, x_scale),
        weight.t(),  # [K, N] column-major, as cuBLASLt wants b
        scale_a=x_scale,
        scale_b=w_scale,
        out_dtype=x.dtype,
    )
    return out if bias is None else out + bias


def _int_mm(x, weight, weight_scale, bias) -> torch.Tensor:
    q, x_scale = quantize_int8_per_token(x)
    acc = torch._int_mm(q, weight.t())  # int32 [M, N]
    out = (acc.float() * x_scale * weight_scale.t()).to(x.dtype)
    return out if bias is None else out + bias


def _scaled_mm_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._scaled_mm with row-wise scales: CUDA sm_89+, K and N multiples of 16, bf16 out."""
    if not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0

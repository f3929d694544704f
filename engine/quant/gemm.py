"""One GEMM per scheme: the single place where a quantized layer's matmul is chosen.

Each function takes the activations x [M, K] and a layer's canonical tensors and returns
[M, N] in x's dtype. Where a fused GPU kernel serves (torch._scaled_mm for FP8 on sm_89+,
torch._int_mm for int8), it is called; everywhere else the layer's dequantized float weight
(computed once off CUDA, `float_weight`; per call on CUDA) runs an ordinary matmul after the
activations go through the same quantization round trip, so the answers follow the quantized
model exactly. The Triton kernels of kvbatch.kernels slot in here, one line per scheme.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvbatch.engine.quant.qdq import (
    FP8_MAX,
    absmax_scale,
    dequantize_scaled,
    fake_quantize_fp8,
    fake_quantize_int8_per_token,
    quantize_fp8,
    quantize_int8_per_token,
)
from kvbatch.engine.quant.wna16_layout import WNA16Weights


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor,  # float32 [N, 1] or [1, 1]
    input_scale: torch.Tensor | None,  # float32 [1, 1] (static) or None (per token)
    bias: torch.Tensor | None,
    float_weight: torch.Tensor | None,  # the dequantized weight, off CUDA
) -> torch.Tensor:
    if _scaled_mm_serves(x, weight):
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
    if float_weight is None:  # CUDA where _scaled_mm does not serve: dequantize per call
        float_weight = dequantize_scaled(weight, weight_scale, x.dtype)
    return F.linear(fake_quantize_fp8(x, input_scale), float_weight, bias)


def int8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # int8 [N, K]
    weight_scale: torch.Tensor,  # float32 [N, 1]
    bias: torch.Tensor | None,
    float_weight: torch.Tensor | None,
) -> torch.Tensor:
    if x.is_cuda and x.shape[0] > 16 and x.shape[1] % 8 == 0 and weight.shape[0] % 8 == 0:
        q, x_scale = quantize_int8_per_token(x)
        acc = torch._int_mm(q, weight.t())  # int32 [M, N]
        out = (acc.float() * x_scale * weight_scale.t()).to(x.dtype)
        return out if bias is None else out + bias
    if float_weight is None:  # CUDA below _int_mm's sizes: dequantize per call
        float_weight = dequantize_scaled(weight, weight_scale, x.dtype)
    return F.linear(fake_quantize_int8_per_token(x), float_weight, bias)


def wna16_linear(
    x: torch.Tensor,  # [M, K]
    weights: WNA16Weights,
    bias: torch.Tensor | None,
    float_weight: torch.Tensor | None,
) -> torch.Tensor:
    if float_weight is None:  # on the GPU: dequantize per call until the W4A16 kernel serves
        float_weight = weights.dequantize().to(x.dtype)
    return F.linear(x, float_weight, bias)


def _scaled_mm_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._scaled_mm with row-wise scales: CUDA sm_89+, K and N multiples of 16, bf16 out."""
    if not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    return x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0

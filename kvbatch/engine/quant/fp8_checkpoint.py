"""`quant_method: "fp8"` checkpoints (vLLM's and AutoFP8's format) and online FP8.

A checkpoint layer holds `weight` float8_e4m3fn [N, K] and `weight_scale` float32 (one value
per tensor, or one per output channel), plus `input_scale` (one value) when the config's
activation_scheme is static. With `weight_block_size` [bn, bk] (DeepSeek-V3's and Qwen3-*-FP8's
layout) a layer holds `weight` and `weight_scale_inv` [ceil(N / bn), ceil(K / bk)]: despite its
name the scale multiplies (weight * scale_inv is the float weight, as transformers'
finegrained_fp8 dequantizes it), and activations are quantized per token and group of bk.
Online FP8 (`quantization="fp8"`) makes the same layer from a
float weight: one scale per output channel (absmax / 448), activations scaled per token.
"""

from __future__ import annotations

import torch

from kvbatch.engine.quant.compressed_tensors import (
    block_fp8_linear,
    channel_scale,
    static_input_scale,
)
from kvbatch.engine.quant.layer_tensors import LayerTensors
from kvbatch.engine.quant.linear import Fp8BlockLinear, Fp8Linear
from kvbatch.engine.quant.qdq import FP8_DTYPE, quantize_fp8_per_channel
from kvbatch.engine.quant.scheme import Fp8BlockW8A8, Fp8W8A8


def load_fp8_linear(
    t: LayerTensors, scheme: Fp8W8A8 | Fp8BlockW8A8, dtype: torch.dtype
) -> Fp8Linear | Fp8BlockLinear:
    if isinstance(scheme, Fp8BlockW8A8):
        return block_fp8_linear(t, scheme, "weight_scale_inv", dtype)
    t.expect(["weight", "weight_scale"] + (["input_scale"] if scheme.static_input_scale else []))
    weight = t.get("weight", (FP8_DTYPE,))
    input_scale = static_input_scale(t) if scheme.static_input_scale else None
    bias = t.optional("bias")
    return Fp8Linear(
        weight,
        channel_scale(t, weight, per_channel=True),
        input_scale,
        None if bias is None else bias.to(dtype),
    )


def quantize_linear_fp8(t: LayerTensors, dtype: torch.dtype, device: torch.device) -> Fp8Linear:
    """A float layer quantized at load: per-channel weight scales, per-token activations."""
    t.expect(["weight"])
    weight = t.get("weight", (torch.float32, torch.float16, torch.bfloat16))
    weight_fp8, scale = quantize_fp8_per_channel(weight.to(device))
    bias = t.optional("bias")
    return Fp8Linear(weight_fp8, scale, None, None if bias is None else bias.to(dtype))

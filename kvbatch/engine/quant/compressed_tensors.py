"""compressed-tensors checkpoints (llm-compressor's format) into the engine's layouts.

As the library (0.20) writes them, per linear layer:
- float-quantized: `weight` float8_e4m3fn [N, K], `weight_scale` float32 [N, 1] (channel) or [1]
  (tensor), `input_scale` [1] for static activations; by blocks (FP8_BLOCK) `weight_scale`
  [ceil(N / bn), ceil(K / bk)] in the model's dtype, one per tile (partial tiles at the ends);
- int-quantized: `weight` int8 [N, K], `weight_scale` [N, 1];
- pack-quantized: `weight_packed` int32 [N, ceil(K * bits / 32)], values packed densely along
  K from the lowest bit (for 4 and 8 bits: value j of a word in bits [bits*j, bits*(j+1))),
  each stored as its signed value plus 2 ** (bits - 1); `weight_shape` [N, K]; `weight_scale`
  [N, G]; with zero points `weight_zero_point` int32 packed the same way along N
  ([ceil(N * bits / 32), G]); act-order `weight_g_idx` int32 [K].
  Symmetric weights dequantize as signed * scale = (unsigned - 2 ** (bits - 1)) * scale.
"""

from __future__ import annotations

import torch

from kvbatch.engine.quant.layer_tensors import LayerTensors
from kvbatch.engine.quant.linear import (
    Fp8BlockLinear,
    Fp8Linear,
    Int8Linear,
    QuantLinear,
    WNA16Linear,
)
from kvbatch.engine.quant.qdq import FP8_DTYPE
from kvbatch.engine.quant.scheme import WNA16, Fp8BlockW8A8, Fp8W8A8, Int8W8A8, LinearScheme
from kvbatch.engine.quant.wna16_layout import WNA16Weights, pack_rows, unpack_columns

FORMAT = "compressed-tensors"


def load_ct_linear(t: LayerTensors, scheme: LinearScheme, dtype: torch.dtype) -> QuantLinear:
    """The layer's quantized module from its compressed-tensors tensors."""
    bias = _bias(t, dtype)
    if isinstance(scheme, Fp8BlockW8A8):
        return block_fp8_linear(t, scheme, "weight_scale", dtype)
    if isinstance(scheme, Fp8W8A8):
        t.expect(
            ["weight", "weight_scale"] + (["input_scale"] if scheme.static_input_scale else [])
        )
        weight = t.get("weight", (FP8_DTYPE,))
        scale = channel_scale(t, weight, per_channel=scheme.per_channel_weights)
        input_scale = static_input_scale(t) if scheme.static_input_scale else None
        return Fp8Linear(weight, scale, input_scale, bias)
    if isinstance(scheme, Int8W8A8):
        t.expect(["weight", "weight_scale"])
        weight = t.get("weight", (torch.int8,))
        return Int8Linear(weight, channel_scale(t, weight, per_channel=True), bias)
    return WNA16Linear(ct_wna16_weights(t, scheme, dtype), bias)


def ct_wna16_weights(t: LayerTensors, scheme: WNA16, dtype: torch.dtype) -> WNA16Weights:
    """pack-quantized tensors -> the canonical layout."""
    required = ["weight_packed", "weight_scale", "weight_shape"]
    if not scheme.symmetric:
        required.append("weight_zero_point")
    t.expect(required, optional=["weight_g_idx"])
    bits, offset = scheme.bits, 1 << (scheme.bits - 1)
    n, k = (int(v) for v in t.get("weight_shape").tolist())
    packed = t.get("weight_packed", (torch.int32,))
    t.check_shape("weight_packed", (n, -(-k * bits // 32)), packed)
    pack = 32 // bits
    if k % pack:
        raise t.error(f"K={k} is not a multiple of {pack} (packed {bits}-bit rows)")
    q = unpack_columns(packed, bits)[:, :k]  # [N, K] unsigned
    scale = t.get("weight_scale")
    group_size = scheme.group_size or k
    groups = -(-k // group_size)
    t.check_shape("weight_scale", (n, groups), scale)
    if scheme.symmetric:
        zeros = torch.full((groups, n), float(offset), dtype=dtype)
    else:
        zp = t.get("weight_zero_point", (torch.int32,))
        t.check_shape("weight_zero_point", (-(-n * bits // 32), groups), zp)
        zeros = unpack_columns(zp.t().contiguous(), bits)[:, :n].to(dtype)  # [G, N]
    g_idx = t.optional("weight_g_idx")
    if g_idx is not None:
        t.check_shape("weight_g_idx", (k,), g_idx)
        g_idx = g_idx.to(torch.int32)
    return WNA16Weights(
        qweight=pack_rows(q.t(), bits),
        scales=scale.t().to(dtype).contiguous(),
        zeros=zeros.contiguous(),
        g_idx=g_idx,
        group_size=group_size,
        bits=bits,
    )


def block_fp8_linear(
    t: LayerTensors, scheme: Fp8BlockW8A8, scale_name: str, dtype: torch.dtype
) -> Fp8BlockLinear:
    """A block FP8 layer from `weight` and its block scales `scale_name` (weight_scale here,
    weight_scale_inv in DeepSeek's and Qwen's fp8 files: the same multiplier either way)."""
    t.expect(["weight", scale_name])
    weight = t.get("weight", (FP8_DTYPE,))
    scale = t.get(scale_name, (torch.float32, torch.bfloat16, torch.float16))
    (n, k), block = weight.shape, (scheme.block_n, scheme.block_k)
    want = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != want:
        raise t.error(
            f"{scale_name} has shape {tuple(scale.shape)}; a weight of [{n}, {k}] in blocks of "
            f"{list(block)} has {list(want)} block scales"
        )
    return Fp8BlockLinear(weight, scale.float().contiguous(), block, _bias(t, dtype))


def channel_scale(t: LayerTensors, weight: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """weight_scale as float32 [N, 1] (per channel) or [1, 1] (per tensor)."""
    scale = t.get("weight_scale").float()
    n = weight.shape[0]
    if scale.numel() == n and (per_channel or n == 1):
        return scale.reshape(n, 1)
    if scale.numel() == 1:
        return scale.reshape(1, 1)
    raise t.error(f"weight_scale has shape {tuple(scale.shape)} for a weight of {n} rows")


def static_input_scale(t: LayerTensors) -> torch.Tensor:
    """input_scale as float32 [1, 1]: one static scale for every activation of the layer."""
    scale = t.get("input_scale", (torch.float32, torch.bfloat16, torch.float16))
    if scale.numel() != 1:
        raise t.error(
            f"input_scale has shape {tuple(scale.shape)}; a static activation scale is one value"
        )
    return scale.float().reshape(1, 1)


def _bias(t: LayerTensors, dtype: torch.dtype) -> torch.Tensor | None:
    bias = t.optional("bias")
    return None if bias is None else bias.to(dtype)

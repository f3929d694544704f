"""Quantize and dequantize in plain torch: scales for FP8 E4M3 and int8, and the
quantize-then-dequantize round trip that lets a float matmul give a W8A8 layer's answers.

FP8 E4M3 (`torch.float8_e4m3fn`) reaches +-448 and has no infinity, so a scale maps a tensor's
largest magnitude to 448. int8 follows compressed-tensors (the writer of INT8 W8A8
checkpoints, and transformers' reference): the scale maps the largest magnitude to half the
range, 255 / 2 = 127.5, values round to nearest and clamp to [-128, 127].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
INT8_MIN, INT8_MAX = -128.0, 127.0
INT8_HALF_RANGE = (INT8_MAX - INT8_MIN) / 2  # 127.5
_MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero row or token: no division by 0


def absmax_scale(x: torch.Tensor, qmax: float, dim: int | None) -> torch.Tensor:
    """float32 scale mapping |x|'s maximum (over `dim`, kept; None: the whole tensor, [1, 1])
    to `qmax`."""
    x = x.float().abs()
    peak = x.amax().reshape(1, 1) if dim is None else x.amax(dim, keepdim=True)
    return (peak / qmax).clamp_min(_MIN_SCALE)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to E4M3 (saturating at +-448)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (E4M3 weight [N, K], float32 scale [N, 1])."""
    scale = absmax_scale(weight, FP8_MAX, dim=1)
    return quantize_fp8(weight, scale), scale


def fake_quantize_fp8(x: torch.Tensor, static_scale: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] through E4M3 and back: per token (dynamic), or with one static scale."""
    scale = absmax_scale(x, FP8_MAX, dim=-1) if static_scale is None else static_scale
    return (quantize_fp8(x, scale).float() * scale).to(x.dtype)


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scale [M, 1]), symmetric, rounded to nearest."""
    scale = absmax_scale(x, INT8_HALF_RANGE, dim=-1)
    return (x.float() / scale).clamp(INT8_MIN, INT8_MAX).round().to(torch.int8), scale


def fake_quantize_int8_per_token(x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8_per_token(x)
    return (q.float() * scale).to(x.dtype)


def dequantize_scaled(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """An FP8 or int8 weight [N, K] times its float32 scale ([N, 1] or [1, 1]) in `dtype`."""
    return (weight.float() * scale).to(dtype)


def dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """An FP8 weight [N, K] times its block scales [ceil(N / bn), ceil(K / bk)] in `dtype`:
    each [bn, bk] tile (the last ones partial) times its own scale."""
    n, k = weight.shape
    bn, bk = block
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * full).to(dtype)


def fake_quantize_fp8_per_group(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [..., K] through E4M3 and back with one scale per token and group of `group_size`
    along K (absmax / 448; a last group shorter than `group_size` has its own), as
    compressed-tensors' dynamic group strategy and DeepSeek's activation quantization do."""
    k = x.shape[-1]
    pad = -k % group_size  # zeros change no group's absmax
    padded = F.pad(x.float(), (0, pad)).unflatten(-1, (-1, group_size))
    scale = absmax_scale(padded, FP8_MAX, dim=-1)
    out = quantize_fp8(padded, scale).float() * scale
    return out.flatten(-2)[..., :k].to(x.dtype)

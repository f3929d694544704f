"""Stacked expert weights for the fused MoE kernel: float, weight-only 4/8-bit, W8A8,
block-scaled FP8, or MXFP4 (gpt-oss's published experts: kernels/mxfp4.py).

A MoE layer's experts are one projection each, stacked along a leading expert axis E so that
the grouped GEMM (kernels/fused_moe.py) finds expert e's weight at a fixed stride. Each
quantized format keeps the layout of its dense GEMM, stacked:

- WNA16Experts: wna16_gemm's canonical layout (GPTQ's: values packed along K into int32
  words, [ceil(K / P), N] per expert), so a GPTQ, AWQ or compressed-tensors pack-quantized
  checkpoint converts once at load exactly as its dense layers do.
- W8A8Experts: FP8 (E4M3) or int8 weights [N, K] with a float32 scale per output channel;
  activations are quantized to the weight's type per token, or for FP8 with a checkpoint's
  static input scale, one per expert.
- Fp8BlockExperts: FP8 weights [N, K] with a float32 scale per [block_n, block_k] tile
  (DeepSeek-V3's, Qwen3-30B-A3B-FP8's), activations quantized per token and group of block_k
  (kernels/fp8_block_gemm.py's scheme, stacked).

`reference_expert_linear` is what one expert computes on the rows routed to it, in plain
torch: the quantized layer's answer as compressed-tensors' forward and the engine's CPU path
give it (dequantized weight, activations through the quantization round trip), so the MoE
reference agrees with a dense quantized layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbatch.kernels.fp8_block_gemm import quantize_fp8_per_token_group_reference
from kvbatch.kernels.fp8_gemm import (
    FP8_DTYPE,
    quantize_fp8_per_token_reference,
    quantize_fp8_static_reference,
)
from kvbatch.kernels.int8_gemm import quantize_int8_per_token_reference
from kvbatch.kernels.mxfp4 import Mxfp4Experts
from kvbatch.kernels.wna16_gemm import SUPPORTED_BITS, dequantize_wna16

W8A8_DTYPES = (FP8_DTYPE, torch.int8)


@dataclass(frozen=True)
class WNA16Experts:
    """Every expert's 4/8-bit weight-only projection in wna16_gemm's canonical layout, stacked."""

    qweight: torch.Tensor  # int32 [E, ceil(K / P), N], P = 32 // bits, packed along K as wna16_gemm
    scales: torch.Tensor  # [E, G, N] activation dtype
    zeros: torch.Tensor  # [E, G, N] activation dtype (symmetric: 2 ** (bits - 1))
    g_idx: torch.Tensor | None  # int32 [E, K] act-order group of each input row, or None
    group_size: int  # rows per group (K for one group over all of K)
    bits: int  # 4 or 8
    in_features: int  # K (explicit: K need not be a multiple of P)

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 3:
            raise ValueError(
                f"qweight must be int32 [E, ceil(K / {32 // self.bits}), N], got "
                f"{self.qweight.dtype} {tuple(self.qweight.shape)}"
            )
        E, words, N = self.qweight.shape
        K, pack = self.in_features, 32 // self.bits
        if K <= 0 or words != -(-K // pack):
            raise ValueError(
                f"qweight has {words} rows of {pack} packed {self.bits}-bit values; "
                f"in_features = {K} needs {-(-K // pack)}"
            )
        if (
            self.scales.dim() != 3
            or self.scales.shape != self.zeros.shape
            or (self.scales.shape[0], self.scales.shape[2]) != (E, N)
        ):
            raise ValueError(
                f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must "
                f"both be [{E}, G, {N}]"
            )
        if not self.scales.is_floating_point() or not self.zeros.is_floating_point():
            raise ValueError(
                f"scales and zeros must be floating point (the activation dtype), got "
                f"{self.scales.dtype} and {self.zeros.dtype}"
            )
        if self.group_size <= 0:
            raise ValueError(f"group_size must be > 0, got {self.group_size}")
        groups = self.scales.shape[1]
        if self.g_idx is None:
            if groups * self.group_size < K:
                raise ValueError(
                    f"{groups} groups of {self.group_size} cover {groups * self.group_size} "
                    f"of K = {K} rows: pass the checkpoint's group size (or g_idx)"
                )
        elif self.g_idx.shape != (E, K) or self.g_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"g_idx must be int32 [{E}, {K}], got {self.g_idx.dtype} {tuple(self.g_idx.shape)}"
            )

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[2]

    def dequantize_expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [N, K] in `dtype`: dequantized in float32, rounded once (what the
        kernel computes in registers)."""
        g_idx = self.g_idx[e] if self.g_idx is not None else None
        w = dequantize_wna16(
            self.qweight[e],
            self.scales[e],
            self.zeros[e],
            g_idx,
            self.group_size,
            self.bits,
            self.in_features,
        )  # [K, N] float32
        return w.t().to(dtype).contiguous()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight [E, N, K] in `dtype`."""
        return torch.stack([self.dequantize_expert(e, dtype) for e in range(self.num_experts)])


class _StackedWeight:
    """(E, N, K) of records that hold every expert's weight as one [E, N, K] tensor."""

    weight: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    @property
    def in_features(self) -> int:
        return self.weight.shape[2]


@dataclass(frozen=True)
class W8A8Experts(_StackedWeight):
    """Every expert's FP8 or int8 weight with per-output-channel scales, stacked; activations are
    quantized to the weight's type: per token (input_scale None) or with a static scale per
    expert (FP8 only)."""

    weight: torch.Tensor  # float8_e4m3fn or int8 [E, N, K]
    weight_scale: torch.Tensor  # float32 [E, N, 1]
    input_scale: torch.Tensor | None  # float32 [E] static per expert (FP8), None: per token

    def __post_init__(self) -> None:
        if self.weight.dtype not in W8A8_DTYPES or self.weight.dim() != 3:
            raise ValueError(
                f"weight must be float8_e4m3fn or int8 [E, N, K], got {self.weight.dtype} "
                f"{tuple(self.weight.shape)}"
            )
        E, N, _ = self.weight.shape
        if self.weight_scale.dtype != torch.float32 or self.weight_scale.shape != (E, N, 1):
            raise ValueError(
                f"weight_scale must be float32 [{E}, {N}, 1] (per output channel), got "
                f"{self.weight_scale.dtype} {tuple(self.weight_scale.shape)}"
            )
        if self.input_scale is None:
            return
        if self.weight.dtype == torch.int8:
            raise ValueError(
                "int8 W8A8 experts quantize activations per token: input_scale must be None "
                "(static int8 activation scales are not supported)"
            )
        if self.input_scale.dtype != torch.float32 or self.input_scale.shape != (E,):
            raise ValueError(
                f"input_scale must be float32 [{E}] (one static scale per expert) or None, got "
                f"{self.input_scale.dtype} {tuple(self.input_scale.shape)}"
            )

    @property
    def is_int8(self) -> bool:
        return self.weight.dtype == torch.int8

    def dequantize_expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [N, K]: weight * weight_scale in float32, rounded to `dtype`."""
        return (self.weight[e].float() * self.weight_scale[e]).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight [E, N, K] in `dtype`."""
        return (self.weight.float() * self.weight_scale).to(dtype)

    def fake_quantize_input(self, rows: torch.Tensor, e: int) -> torch.Tensor:
        """rows [n, K] through expert e's activation quantization and back, in rows' dtype:
        FP8 per token or with input_scale[e], int8 per token (compressed-tensors' rounding)."""
        if self.is_int8:
            q, scale = quantize_int8_per_token_reference(rows)
        elif self.input_scale is None:
            q, scale = quantize_fp8_per_token_reference(rows)
        else:
            scale = self.input_scale[e].reshape(1, 1)
            q = quantize_fp8_static_reference(rows, scale)
        return (q.float() * scale).to(rows.dtype)


@dataclass(frozen=True)
class Fp8BlockExperts(_StackedWeight):
    """Every expert's block-scaled FP8 weight, stacked; activations are quantized per token and
    group of block_k along K."""

    weight: torch.Tensor  # float8_e4m3fn [E, N, K]
    weight_scale: torch.Tensor  # float32 [E, ceil(N / block_n), ceil(K / block_k)]
    block_n: int
    block_k: int

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 3:
            raise ValueError(
                f"weight must be float8_e4m3fn [E, N, K], got {self.weight.dtype} "
                f"{tuple(self.weight.shape)}"
            )
        E, N, K = self.weight.shape
        want = (E, -(-N // self.block_n), -(-K // self.block_k))
        if self.weight_scale.dtype != torch.float32 or tuple(self.weight_scale.shape) != want:
            raise ValueError(
                f"weight_scale must be float32 {list(want)} (blocks of "
                f"[{self.block_n}, {self.block_k}]), got {self.weight_scale.dtype} "
                f"{tuple(self.weight_scale.shape)}"
            )

    @property
    def block(self) -> tuple[int, int]:
        return self.block_n, self.block_k

    def dequantize_expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [N, K]: each tile times its scale in float32, rounded to `dtype`."""
        n, k = self.weight.shape[1:]
        scale = self.weight_scale[e].repeat_interleave(self.block_n, 0)[:n]
        scale = scale.repeat_interleave(self.block_k, 1)[:, :k]
        return (self.weight[e].float() * scale).to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight [E, N, K] in `dtype`."""
        return torch.stack([self.dequantize_expert(e, dtype) for e in range(self.num_experts)])

    def fake_quantize_input(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, K] through FP8 per token and group of block_k and back, in rows' dtype."""
        q, scale = quantize_fp8_per_token_group_reference(rows, self.block_k)
        k = rows.shape[1]
        full = scale.repeat_interleave(self.block_k, 1)[:, :k]
        return (q.float() * full).to(rows.dtype)


ExpertWeights = torch.Tensor | WNA16Experts | W8A8Experts | Fp8BlockExperts | Mxfp4Experts


def expert_shape(w: ExpertWeights) -> tuple[int, int, int]:
    """(E, N, K) of stacked expert weights whatever their format."""
    if isinstance(w, torch.Tensor):
        if w.dim() != 3:
            raise ValueError(f"stacked expert weights must be [E, N, K], got {tuple(w.shape)}")
        return tuple(w.shape)
    return w.num_experts, w.out_features, w.in_features


def reference_expert_linear(rows: torch.Tensor, w: ExpertWeights, e: int) -> torch.Tensor:
    """Expert e's projection of rows [n, K] -> [n, N] in rows' dtype, in plain torch. Only
    expert e is dequantized."""
    if isinstance(w, torch.Tensor):
        return F.linear(rows, w[e])
    if isinstance(w, (WNA16Experts, Mxfp4Experts)):  # weight-only: activations as they are
        return F.linear(rows, w.dequantize_expert(e, rows.dtype))
    if isinstance(w, Fp8BlockExperts):
        return F.linear(w.fake_quantize_input(rows), w.dequantize_expert(e, rows.dtype))
    return F.linear(w.fake_quantize_input(rows, e), w.dequantize_expert(e, rows.dtype))

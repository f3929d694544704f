"""Random stacked quantized experts for the MoE tests (tests/kernels/test_moe_weights.py and
test_fused_moe_quant.py), built from their formats' definitions."""

from __future__ import annotations

import torch

from kvbatch.kernels.fp8_gemm import FP8_DTYPE
from kvbatch.kernels.moe_weights import W8A8Experts, WNA16Experts
from kvbatch.kernels.wna16_gemm import pack_qweight

W8A8_KINDS = ("fp8-dynamic", "fp8-static", "int8")


def random_wna16_experts(
    num_experts: int,
    n: int,
    k: int,
    bits: int,
    group_size: int,
    *,
    act_order: bool,
    sym: bool,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> WNA16Experts:
    """Experts [E, N, K] of random unsigned values packed in the canonical layout, scales that
    keep the dequantized weights near +-0.2, zeros 2**(bits-1) when `sym` (random otherwise),
    and with `act_order` a g_idx per expert that sends each row to a random group (every
    group used)."""
    groups = -(-k // group_size)
    q = torch.randint(0, 2**bits, (num_experts, k, n), generator=gen)
    scales = (torch.rand(num_experts, groups, n, generator=gen) + 0.5) * (0.4 / 2**bits)
    if sym:
        zeros = torch.full((num_experts, groups, n), 2.0 ** (bits - 1))
    else:
        zeros = torch.randint(0, 2**bits, (num_experts, groups, n), generator=gen).float()
    g_idx = None
    if act_order:
        rows_to_groups = [
            (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)] for _ in q
        ]
        g_idx = torch.stack(rows_to_groups).to(device=device, dtype=torch.int32)
    return WNA16Experts(
        qweight=torch.stack([pack_qweight(qe, bits) for qe in q]).to(device),
        scales=scales.to(device=device, dtype=dtype),
        zeros=zeros.to(device=device, dtype=dtype),
        g_idx=g_idx,
        group_size=group_size,
        bits=bits,
        in_features=k,
    )


def random_w8a8_experts(
    num_experts: int,
    n: int,
    k: int,
    kind: str,
    *,
    gen: torch.Generator,
    device: torch.device | str = "cpu",
) -> W8A8Experts:
    """Random float experts [E, N, K] quantized per output channel to FP8 or int8 (`kind`, one
    of W8A8_KINDS); "fp8-static" adds a static input scale per expert, one that clips the
    largest activations of unit-variance inputs (saturation is part of the format)."""
    w = torch.randn(num_experts, n, k, generator=gen) * 0.2
    if kind == "int8":
        scale = w.abs().amax(-1, keepdim=True) / 127.0
        weight = (w / scale).round().clamp(-128, 127).to(torch.int8)
    else:
        scale = w.abs().amax(-1, keepdim=True) / 448.0
        weight = (w / scale).to(FP8_DTYPE)
    input_scale = None
    if kind == "fp8-static":
        input_scale = (torch.rand(num_experts, generator=gen) * 0.002 + 0.005).to(device)
    return W8A8Experts(
        weight=weight.to(device), weight_scale=scale.float().to(device), input_scale=input_scale
    )

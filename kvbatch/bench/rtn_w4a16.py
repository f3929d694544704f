"""Round-to-nearest W4A16 for the benchmarks' random-weight models, written as a GPTQ
checkpoint (checkpoint_format gptq_v2: zero points stored as they are).

Random weights have no calibration data, so GPTQ's error correction has nothing to work on:
plain rounding gives the same tensors, shapes and bytes, which is all a speed benchmark reads.
Each linear weight w [N, K] of the decoder layers is cut into groups of GROUP_SIZE input rows;
a group's scale maps its largest magnitude to 7, values round to [-8, 7] and are stored
offset by the symmetric zero point 8:

    q[k, n] = clamp(round(w[n, k] / scale[g, n]), -8, 7) + 8,   scale = absmax / 7

Which layers (and MoE experts, one projection each): random_quant.py.
Not for quality figures: a real checkpoint is quantized by its own tools (tests/engine/quant).
"""

from __future__ import annotations

from typing import Any

import torch

from kvbatch.bench.random_quant import quantize_decoder_linears
from kvbatch.engine.quant.wna16_layout import pack_rows

BITS = 4
GROUP_SIZE = 128
ZERO_POINT = 1 << (BITS - 1)  # 8: symmetric


def gptq_quantization_config() -> dict[str, Any]:
    """config.json's quantization_config for the tensors quantize_rtn writes."""
    return {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": GROUP_SIZE,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq_v2",
    }


def quantize_rtn(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float state dict -> the same with every decoder linear as GPTQ tensors (qweight,
    qzeros, scales) in place of its `weight` (random_quant.py says which); the rest unchanged."""
    return quantize_decoder_linears(weights, gptq_tensors)


def gptq_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear weight [N, K] (K a multiple of 8) -> {qweight, qzeros, scales}."""
    n, k = weight.shape
    groups = -(-k // GROUP_SIZE)
    w = weight.float().t()  # [K, N]
    padded = torch.zeros(groups * GROUP_SIZE, n, device=w.device)
    padded[:k] = w
    by_group = padded.reshape(groups, GROUP_SIZE, n)
    scales = (by_group.abs().amax(dim=1) / (ZERO_POINT - 1)).clamp_min(1e-8)  # [G, N]
    q = (by_group / scales[:, None, :]).round().clamp(-ZERO_POINT, ZERO_POINT - 1) + ZERO_POINT
    q = q.reshape(-1, n)[:k].to(torch.int64)  # [K, N] in [0, 16)
    zeros = torch.full((n, groups), ZERO_POINT, dtype=torch.int64, device=w.device)
    return {
        "qweight": pack_rows(q, BITS).contiguous(),  # [K / 8, N]
        "qzeros": pack_rows(zeros, BITS).t().contiguous(),  # [G, N / 8], packed along N
        "scales": scales.to(torch.float16).contiguous(),
    }

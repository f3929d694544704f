"""Round-to-nearest W4A16 for the benchmarks' random-weight models, written as a GPTQ
checkpoint (checkpoint_format gptq_v2: zero points stored as they are).

Random weights have no calibration data, so GPTQ's error correction has nothing to work on:
plain rounding gives the same tensors, shapes and bytes, which is all a speed benchmark reads.
Each linear weight w [N, K] of the decoder layers is cut into groups of GROUP_SIZE input rows;
a group's scale maps its largest magnitude to 7, values round to [-8, 7] and are stored
offset by the symmetric zero point 8:

    q[k, n] = clamp(round(w[n, k] / scale[g, n]), -8, 7) + 8,   scale = absmax / 7

Embeddings, norms, the output projection and MoE routers stay in float, as in published W4A16
models. A mixture-of-experts model's stacked experts (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I], as transformers names them) are written one projection per
expert (`mlp.experts.3.gate_proj.qweight`, ...), as GPTQ tools write MoE checkpoints.
Not for quality figures: a real checkpoint is quantized by its own tools (tests/engine/quant).
"""

from __future__ import annotations

from typing import Any

import torch

from kvbatch.engine.quant.wna16_layout import pack_rows

BITS = 4
GROUP_SIZE = 128
ZERO_POINT = 1 << (BITS - 1)  # 8: symmetric
QUANTIZED_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


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
    qzeros, scales) in place of its `weight`; the rest unchanged. The rounding runs on the GPU
    when there is one (a few seconds for billions of weights), the result is on the CPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _per_expert(weights):
        if not name.endswith(QUANTIZED_SUFFIXES):
            out[name] = tensor
            continue
        prefix = name.removesuffix("weight")
        packed = gptq_tensors(tensor.to(device))
        out.update({prefix + k: v.cpu() for k, v in packed.items()})
    return out


def _per_expert(weights: dict[str, torch.Tensor]):
    """(name, tensor) of `weights` with stacked experts split into one linear per expert."""
    for name, tensor in weights.items():
        if name.endswith(".experts.gate_up_proj"):
            base, inter = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e, w in enumerate(tensor):
                yield f"{base}{e}.gate_proj.weight", w[:inter]
                yield f"{base}{e}.up_proj.weight", w[inter:]
        elif name.endswith(".experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, w in enumerate(tensor):
                yield f"{base}{e}.down_proj.weight", w
        else:
            yield name, tensor


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

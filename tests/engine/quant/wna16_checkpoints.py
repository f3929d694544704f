"""Tiny GPTQ and AWQ checkpoints packed by the libraries' published packers
(published_wna16.py), each with a float twin whose weights are those libraries' own
dequantization of the same bytes: what transformers would run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig

from tests.engine.quant import published_wna16 as published
from tests.engine.quant.moe_checkpoints import linearized_moe_model
from tests.tiny_models import BOS, EOS, MOE_KINDS, randomize_weights, tiny_config

GROUP_SIZE = 32
# An expert's gate and up projections read the same input: GPTQ's act order (from that
# input's statistics) is the same for both.
_SHARED_INPUT = re.compile(r"\.experts\.(\d+)\.(?:gate_proj|up_proj|w1|w3)$")


def build_wna16_checkpoint(
    fmt: str, bits: int, act_order: bool, path: Path, seed: int = 0, kind: str = "llama-gqa"
):
    """Write `path/quantized` (format "gptq", "gptq_v2" or "awq") and `path/reference` (float
    weights = the library's dequantization); return both folders. A mixture-of-experts `kind`
    has its experts quantized one projection at a time, as the GPTQ/AWQ tools write them."""
    if kind in MOE_KINDS:
        model = linearized_moe_model(kind, seed)
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
        randomize_weights(model, seed)
        model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    g = torch.Generator().manual_seed(seed + 7)
    quantized_dir, reference_dir = Path(path) / "quantized", Path(path) / "reference"
    tensors: dict[str, torch.Tensor] = {}
    orders: dict[str, torch.Tensor] = {}  # g_idx by input: an expert's gate and up share one
    with torch.no_grad():
        for name, linear in model.named_modules():
            if not isinstance(linear, torch.nn.Linear) or name == "lm_head":
                continue
            key = _SHARED_INPUT.sub(r".experts.\1.gate_up", name)
            if key not in orders:
                orders[key] = _group_index(linear.in_features, act_order, g)
            packed, dequantized = _quantize(linear.weight, fmt, bits, orders[key])
            tensors.update({f"{name}.{k}": v for k, v in packed.items()})
            linear.weight.copy_(dequantized.t())
    model.save_pretrained(reference_dir)
    state = load_file(str(reference_dir / "model.safetensors"))
    for name in {k.rsplit(".", 1)[0] for k in tensors}:
        del state[name + ".weight"]
    state.update(tensors)
    model.save_pretrained(quantized_dir)
    save_file(state, str(quantized_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"] = _config(fmt, bits, act_order)
    (quantized_dir / "config.json").write_text(json.dumps(config))
    return quantized_dir, reference_dir


def _config(fmt: str, bits: int, act_order: bool) -> dict:
    if fmt == "awq":
        return dict(
            quant_method="awq", bits=4, group_size=GROUP_SIZE, zero_point=True, version="gemm"
        )
    return dict(
        quant_method="gptq",
        bits=bits,
        group_size=GROUP_SIZE,
        desc_act=act_order,
        sym=False,
        checkpoint_format=fmt,
    )


def _group_index(k: int, act_order: bool, g: torch.Generator) -> torch.Tensor:
    """Each input row's group: in order, or (act_order) in a random order of importance."""
    if not act_order:
        return torch.arange(k, dtype=torch.int32) // GROUP_SIZE
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=g)] = torch.arange(k, dtype=torch.int32) // GROUP_SIZE
    return g_idx


def _quantize(weight: torch.Tensor, fmt: str, bits: int, g_idx: torch.Tensor):
    """Asymmetric min-max quantization of weight [N, K] by groups of input rows (g_idx) ->
    (the format's tensors, the library's dequantized weight [K, N])."""
    n, k = weight.shape
    groups, qmax = k // GROUP_SIZE, (1 << bits) - 1
    w = weight.t()  # [K, N]
    lo = torch.stack([w[g_idx == i].amin(0) for i in range(groups)]).clamp(max=0)
    hi = torch.stack([w[g_idx == i].amax(0) for i in range(groups)]).clamp(min=0)
    scales = ((hi - lo) / qmax).clamp(min=1e-6).half()  # [G, N]
    zeros = torch.round(-lo / scales.float()).clamp(0, qmax).to(torch.int32)  # [G, N]
    rows = g_idx.long()
    intweight = torch.round(w / scales.float()[rows] + zeros[rows]).clamp(0, qmax).to(torch.int32)
    if fmt == "awq":
        qweight, qzeros = published.awq_pack(intweight, zeros)
        packed = dict(qweight=qweight, qzeros=qzeros, scales=scales)
        dequantized = published.awq_dequantize(qweight, qzeros, scales.float(), 4, GROUP_SIZE)
        return packed, dequantized
    qweight, qzeros = published.gptq_pack(intweight, zeros, bits, v1=fmt == "gptq")
    packed = dict(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx.clone())
    dequantized = published.gptq_dequantize(
        qweight, qzeros, scales.float(), g_idx, bits, v1=fmt == "gptq"
    )
    return packed, dequantized

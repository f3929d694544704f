"""gpt-oss's MXFP4 experts as published: read at load, kept 4-bit, run by the fused MoE.

config.json says

    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn",
                                                       "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"]}

and each MoE layer stores its experts' two projections as (transformers' integrations/mxfp4.py
reads the same tensors)

    mlp.experts.gate_up_proj_blocks  uint8 [E, 2I, H / 32, 16]   rows: gate 0, up 0, gate 1, ...
    mlp.experts.gate_up_proj_scales  uint8 [E, 2I, H / 32]
    mlp.experts.down_proj_blocks     uint8 [E, H, I / 32, 16]
    mlp.experts.down_proj_scales     uint8 [E, H, I / 32]
    mlp.experts.{gate_up,down}_proj_bias   float, as a float checkpoint's

(kernels/mxfp4.py has the encoding). engine/models/gpt_oss.py reorders gate_up's rows to
gate-then-up as the engine's experts hold them; `install_mxfp4_experts` then replaces each
MoE block's float experts by `Mxfp4StackedExperts`, whose `gate_up_proj` and `down_proj` are
the packed bytes (kernels/mxfp4.Mxfp4Experts): 4.25 bits a weight in memory, on every device.
Everything else of the checkpoint is float and loads as usual.

A checkpoint that does not hold what its config says fails naming the tensor: a missing
`*_scales`, blocks whose shape is not the model's, float experts under an mxfp4 config that
does not list them in modules_to_not_convert.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from kvbatch.engine.layers.moe import SparseMoeBlock
from kvbatch.engine.quant.scheme import QuantConfig
from kvbatch.kernels.fused_moe import ExpertBiases
from kvbatch.kernels.mxfp4 import MXFP4_BLOCK_BYTES, MXFP4_GROUP, Mxfp4Experts

MXFP4_METHOD = "mxfp4"
PROJECTIONS = ("gate_up_proj", "down_proj")


def read_mxfp4_config(qc: Mapping) -> QuantConfig:
    """config.json's mxfp4 quantization_config: the experts in MXFP4, every Linear in float
    (transformers converts only GptOssExperts); modules_to_not_convert may keep experts float."""
    keep = qc.get("modules_to_not_convert") or ()
    if isinstance(keep, str) or not all(isinstance(m, str) for m in keep):
        raise ValueError(
            f"quantization_config.modules_to_not_convert must be a list of module names, got "
            f"{keep!r}"
        )
    return QuantConfig(method=MXFP4_METHOD, format=MXFP4_METHOD, rules=(), ignore=tuple(keep))


def experts_kept_in_float(quant: QuantConfig, experts: str) -> bool:
    """Whether modules_to_not_convert names `experts` ("model.layers.0.mlp.experts"), as
    transformers' should_convert_module matches it: a name, a prefix, or a `*` pattern."""
    for pattern in quant.ignore:
        if pattern == experts or experts.startswith(pattern + "."):
            return True
        if "*" in pattern and _glob(pattern, experts):
            return True
    return False


def _glob(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    if len(parts) > len(names):
        return False
    return all(p == "*" or p == n for p, n in zip(parts, names))


class Mxfp4StackedExperts(nn.Module):
    """Stand-in for layers/moe.py StackedExperts with MXFP4 weights: the packed bytes as
    buffers (`.to(device)` moves them, the state dict lists them) and float biases."""

    def __init__(self, gate_up: Mxfp4Experts, down: Mxfp4Experts, bias_shapes) -> None:
        super().__init__()
        for proj, w in zip(PROJECTIONS, (gate_up, down)):
            self.register_buffer(f"{proj}_blocks", w.blocks)
            self.register_buffer(f"{proj}_scales", w.scales)
        gate_up_bias, down_bias = bias_shapes
        with torch.device("meta"):  # loaded from the checkpoint like every float tensor
            self.gate_up_proj_bias = nn.Parameter(torch.empty(gate_up_bias))
            self.down_proj_bias = nn.Parameter(torch.empty(down_bias))

    @property
    def gate_up_proj(self) -> Mxfp4Experts:  # [E, 2I, H]: gate rows, then up rows
        return Mxfp4Experts(self.gate_up_proj_blocks, self.gate_up_proj_scales)

    @property
    def down_proj(self) -> Mxfp4Experts:  # [E, H, I]
        return Mxfp4Experts(self.down_proj_blocks, self.down_proj_scales)

    @property
    def biases(self) -> ExpertBiases:
        return ExpertBiases(self.gate_up_proj_bias, self.down_proj_bias)


def install_mxfp4_experts(
    model: nn.Module, state_dict: dict[str, torch.Tensor], quant: QuantConfig, device
) -> None:
    """Replace every MoE block's float experts by its MXFP4 ones, taking their blocks and
    scales out of `state_dict`; experts the config keeps in float stay as they are."""
    if quant.method != MXFP4_METHOD:
        return
    for name, block in model.named_modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        prefix = f"{name}.experts."
        if experts_kept_in_float(quant, prefix[:-1]):
            continue
        packed = [_read_projection(state_dict, prefix, proj, block) for proj in PROJECTIONS]
        float_experts = block.experts
        block.experts = Mxfp4StackedExperts(
            packed[0].to(device),
            packed[1].to(device),
            (float_experts.gate_up_proj_bias.shape, float_experts.down_proj_bias.shape),
        )


def _read_projection(
    state_dict: dict[str, torch.Tensor], prefix: str, proj: str, block: SparseMoeBlock
) -> Mxfp4Experts:
    """One projection's blocks and scales, checked against the model's [E, N, K]."""
    blocks_name, scales_name = f"{prefix}{proj}_blocks", f"{prefix}{proj}_scales"
    if blocks_name not in state_dict:
        if f"{prefix}{proj}" in state_dict:
            raise ValueError(
                f"{prefix}{proj} is a float tensor but config.json's quantization_config is "
                f"mxfp4, which stores experts as {proj}_blocks and {proj}_scales: remove the "
                "quantization_config (a dequantized checkpoint) or list the experts in "
                "modules_to_not_convert"
            )
        raise ValueError(f"checkpoint is missing {blocks_name} (mxfp4 experts)")
    if scales_name not in state_dict:
        raise ValueError(
            f"checkpoint has {blocks_name} but not {scales_name}: MXFP4 blocks need their "
            "E8M0 scales (one per 32 values)"
        )
    blocks, scales = state_dict.pop(blocks_name), state_dict.pop(scales_name)
    e, n, k = getattr(block.experts, proj).shape  # the float experts on meta: [E, N, K]
    want = (e, n, k // MXFP4_GROUP, MXFP4_BLOCK_BYTES)
    if k % MXFP4_GROUP:
        raise ValueError(f"{blocks_name}: MXFP4 needs the input size ({k}) a multiple of 32")
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
        raise ValueError(
            f"{blocks_name} is {str(blocks.dtype).removeprefix('torch.')} "
            f"{list(blocks.shape)}; the model built from config.json needs uint8 {list(want)} "
            "(experts, out features, in features / 32, 16 bytes)"
        )
    if scales.dtype != torch.uint8 or tuple(scales.shape) != want[:3]:
        raise ValueError(
            f"{scales_name} is {str(scales.dtype).removeprefix('torch.')} "
            f"{list(scales.shape)}; the model needs uint8 {list(want[:3])} (one E8M0 exponent "
            "per 32 values)"
        )
    return Mxfp4Experts(blocks.contiguous(), scales.contiguous())

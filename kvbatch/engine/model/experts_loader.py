"""A mixture-of-experts checkpoint's experts into the model: stacked float tensors, or each
layer's quantized experts read by their format's converter and stacked (engine/quant/experts.py).

The order matters: float experts are stacked into the state dict before the model is built
(they load like any weight); quantized ones replace the built model's `experts` modules, as
quantized linears replace nn.Linear modules.
"""

from __future__ import annotations

import torch
from torch import nn

from kvbatch.engine.layers.moe import SparseMoeBlock
from kvbatch.engine.model.moe import CheckpointExperts, collect_expert_tensors
from kvbatch.engine.quant.apply import format_name, load_quantized_linear
from kvbatch.engine.quant.experts import quantize_experts_fp8, stack_quantized_experts
from kvbatch.engine.quant.layer_tensors import LayerTensors
from kvbatch.engine.quant.scheme import QuantConfig

ONLINE_FORMAT = "online-fp8"


def split_experts(
    state_dict: dict[str, torch.Tensor], num_experts: int, quant: QuantConfig | None
) -> tuple[dict[str, torch.Tensor], list[CheckpointExperts]]:
    """The state dict with every float layer's experts stacked (and Mixtral's names mapped),
    and the layers whose experts the checkpoint quantized, for install_quantized_experts."""
    state_dict, layers = collect_expert_tensors(state_dict, num_experts)
    quantized = []
    for experts in layers:
        if _is_quantized(experts, quant):
            quantized.append(experts)
        else:
            state_dict.update(experts.stack_float(num_experts))
    return state_dict, quantized


def _is_quantized(experts: CheckpointExperts, quant: QuantConfig | None) -> bool:
    """Whether the config quantizes this layer's experts: all of them or none."""
    if quant is None or quant.format == ONLINE_FORMAT:  # online: quantized once stacked
        return False
    names = [name for name, _ in experts.linears.values()]
    schemes = [quant.scheme_for(name) is not None for name in names]
    if all(schemes):
        return True
    if any(schemes):
        shown = ", ".join(n for n, s in zip(names, schemes) if not s)
        raise ValueError(
            f"the {quant.method} config quantizes some of {experts.block}'s experts but not "
            f"{shown}: the experts of a layer are run together and must share a scheme"
        )
    return False


def install_quantized_experts(
    model: nn.Module,
    layers: list[CheckpointExperts],
    num_experts: int,
    quant: QuantConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Replace each listed layer's float experts by its quantized ones, read from the
    checkpoint's tensors (taken out of `layers` as they are read)."""
    fmt = format_name(quant)
    for experts in layers:

        def load(e: int, proj: str, experts=experts):
            name, tensors = experts.linears.pop((e, proj))
            return load_quantized_linear(LayerTensors(name, fmt, tensors), quant, dtype, device)

        stacked = stack_quantized_experts(experts.block, num_experts, load)
        _check_shapes(model.get_submodule(experts.block).experts, stacked, experts.block)
        model.get_submodule(experts.block).experts = stacked


def quantize_experts_online(
    model: nn.Module, state_dict: dict[str, torch.Tensor], quant: QuantConfig | None, device
) -> None:
    """Online FP8: every MoE block's stacked float experts quantized per output channel."""
    if quant is None or quant.format != ONLINE_FORMAT:
        return
    for name, block in model.named_modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        gate_up = state_dict.pop(f"{name}.experts.gate_up_proj", None)
        down = state_dict.pop(f"{name}.experts.down_proj", None)
        if gate_up is None or down is None:
            continue  # the "missing weights" check names them
        stacked = quantize_experts_fp8(gate_up.to(device), down.to(device))
        _check_shapes(block.experts, stacked, name)
        block.experts = stacked


def _check_shapes(float_experts: nn.Module, stacked, block: str) -> None:
    """The quantized experts' [E, N, K] against the model's float ones (on meta)."""
    for proj in ("gate_up_proj", "down_proj"):
        want = tuple(getattr(float_experts, proj).shape)
        w = getattr(stacked, proj)
        got = (w.num_experts, w.out_features, w.in_features)
        if got != want:
            raise ValueError(
                f"{block}'s quantized experts' {proj} is [E, N, K] = {list(got)}, the model "
                f"needs {list(want)}"
            )

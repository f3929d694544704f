"""Quantized experts of a mixture-of-experts layer, stacked as the fused MoE kernel takes them.

A quantized MoE checkpoint stores each expert's projections as separate linear layers in its
format (compressed-tensors, GPTQ, AWQ, fp8), the way llm-compressor and the GPTQ/AWQ tools
write them. Each one is read by the same converter as a dense layer of that format (apply.py),
so a format has one reader, and the canonical tensors are then stacked per projection into
kvbatch.kernels.moe_weights' layouts:

    gate_up  [E, 2I, H]   each expert's gate rows, then its up rows
    down     [E, H, I]

- WNA16 (4/8-bit weight-only): qweight, scales and zeros of gate and up concatenated along N,
  stacked along E. Act-order g_idx is per expert; gate and up share their input, so their
  act order is one (GPTQ orders rows by the input's statistics): a checkpoint where the two
  differ cannot share a GEMM and is refused.
- FP8 / int8 W8A8: weights stacked, a per-tensor weight scale widened to one per channel. A
  static FP8 input scale is one per expert and GEMM; gate and up calibrate on the same input,
  so theirs agree, and where a checkpoint's differ the larger is kept (no value clips).
- Block FP8 (Qwen3-30B-A3B-FP8, DeepSeek-V3): weights stacked, block scales [N / bn, K / bk]
  of gate and up concatenated along N and stacked along E. Gate's rows must fill whole
  blocks (I a multiple of bn), or up's first block would share gate's last scale row.
Online FP8 (`quantization="fp8"` on a float checkpoint) quantizes stacked float experts per
output channel, as it does a dense layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import torch
from torch import nn

from kvbatch.engine.quant.linear import (
    Fp8BlockLinear,
    Fp8Linear,
    Int8Linear,
    QuantLinear,
    WNA16Linear,
)
from kvbatch.engine.quant.qdq import quantize_fp8_per_channel
from kvbatch.kernels.moe_weights import (
    ExpertWeights,
    Fp8BlockExperts,
    W8A8Experts,
    WNA16Experts,
)

LoadLinear = Callable[[int, str], QuantLinear]
"""(expert, projection) -> that expert's projection as its quantized linear layer."""


class QuantizedExperts(nn.Module):
    """Stand-in for layers/moe.py StackedExperts: `gate_up_proj` and `down_proj` are the kernel's quantized
    weight records over this module's buffers (so `.to(device)` moves them and the state dict
    lists them). A record is built (and validated) once per set of buffers, not every step."""

    def __init__(self, gate_up: ExpertWeights, down: ExpertWeights) -> None:
        super().__init__()
        self._records: dict[str, tuple[type, dict, tuple[str, ...]]] = {}
        self._built: dict[str, tuple[tuple[int, ...], ExpertWeights]] = {}
        for proj, weights in (("gate_up_proj", gate_up), ("down_proj", down)):
            values = {f.name: getattr(weights, f.name) for f in fields(weights)}
            tensors = tuple(k for k, v in values.items() if isinstance(v, torch.Tensor))
            for name in tensors:
                self.register_buffer(f"{proj}_{name}", values.pop(name))
            self._records[proj] = (type(weights), values, tensors)

    def _weights(self, proj: str) -> ExpertWeights:
        cls, values, names = self._records[proj]
        tensors = {name: getattr(self, f"{proj}_{name}") for name in names}
        key = tuple(id(t) for t in tensors.values())  # new after .to() or a state-dict load
        built = self._built.get(proj)
        if built is None or built[0] != key:
            built = self._built[proj] = (key, cls(**values, **tensors))
        return built[1]

    def _apply(self, fn, *args, **kwargs):
        self._built.clear()  # .to() and the like: the old buffers are not kept alive here
        return super()._apply(fn, *args, **kwargs)

    @property
    def gate_up_proj(self) -> ExpertWeights:
        return self._weights("gate_up_proj")

    @property
    def down_proj(self) -> ExpertWeights:
        return self._weights("down_proj")

    def extra_repr(self) -> str:
        cls, values, _ = self._records["gate_up_proj"]
        return f"{cls.__name__}, " + ", ".join(f"{k}={v}" for k, v in values.items())


def stack_quantized_experts(
    block: str, num_experts: int, load_linear: LoadLinear
) -> QuantizedExperts:
    """Read every expert's gate, up and down projection with `load_linear` and stack them."""
    layers = {
        (e, proj): load_linear(e, proj)
        for e in range(num_experts)
        for proj in ("gate", "up", "down")
    }
    for (e, proj), layer in layers.items():
        if layer.bias is not None:
            raise ValueError(f"{block} expert {e} {proj} has a bias; MoE experts have none")
    gate_up = [(layers[e, "gate"], layers[e, "up"]) for e in range(num_experts)]
    down = [layers[e, "down"] for e in range(num_experts)]
    return QuantizedExperts(_stack(block, "gate_up", gate_up), _stack(block, "down", down))


def _stack(
    block: str, proj: str, experts: list[tuple[QuantLinear, ...]] | list[QuantLinear]
) -> ExpertWeights:
    """Each expert's layers (gate and up, concatenated along N; or down alone) stacked."""
    parts = [p if isinstance(p, tuple) else (p,) for p in experts]
    kinds = {type(layer) for layers in parts for layer in layers}
    if len(kinds) != 1:
        names = ", ".join(sorted(k.__name__ for k in kinds))
        raise ValueError(f"{block}: the experts' {proj} projections mix schemes ({names})")
    kind = kinds.pop()
    if kind is WNA16Linear:
        return _stack_wna16(block, proj, parts)
    if kind in (Fp8Linear, Int8Linear):
        return _stack_scaled(block, proj, parts)
    if kind is Fp8BlockLinear:
        return _stack_blocks(block, proj, parts)
    raise ValueError(f"{block}: no stacked layout for {kind.__name__} experts")


def _stack_wna16(block: str, proj: str, parts: list[tuple[WNA16Linear, ...]]) -> WNA16Experts:
    first = parts[0][0]
    if any(
        (layer.bits, layer.group_size, layer.in_features)
        != (first.bits, first.group_size, first.in_features)
        for layers in parts
        for layer in layers
    ):
        raise ValueError(f"{block}: the experts' {proj} projections differ in bits or groups")
    g_idx = []
    for e, layers in enumerate(parts):
        orders = [layer.g_idx for layer in layers]
        if any((o is None) != (orders[0] is None) for o in orders) or (
            orders[0] is not None and any(not torch.equal(o, orders[0]) for o in orders)
        ):
            raise ValueError(
                f"{block} expert {e}: gate and up have different act orders (g_idx); they "
                "share an input, so a GPTQ writer gives them one"
            )
        g_idx.append(orders[0])
    has_g_idx = g_idx[0] is not None
    if any((g is None) == has_g_idx for g in g_idx):
        raise ValueError(f"{block}: some experts' {proj} projections have act order, some not")

    def stacked(attr: str) -> torch.Tensor:  # concatenated along N, stacked along E
        return torch.stack([torch.cat([getattr(x, attr) for x in layers], 1) for layers in parts])

    return WNA16Experts(
        qweight=stacked("qweight"),
        scales=stacked("scales"),
        zeros=stacked("zeros"),
        g_idx=torch.stack(g_idx).to(torch.int32) if has_g_idx else None,
        group_size=first.group_size,
        bits=first.bits,
        in_features=first.in_features,
    )


def _stack_scaled(block: str, proj: str, parts: list[tuple[QuantLinear, ...]]) -> W8A8Experts:
    static = {getattr(x, "input_scale", None) is not None for layers in parts for x in layers}
    if len(static) != 1:
        raise ValueError(
            f"{block}: the experts' {proj} projections mix static and dynamic activation "
            "scales (some have input_scale, some not); one fused GEMM takes one kind"
        )
    weight = torch.stack([torch.cat([x.weight for x in layers]) for layers in parts])
    scale = torch.stack(
        [
            torch.cat([x.weight_scale.float().expand(x.out_features, 1) for x in layers])
            for layers in parts
        ]
    )
    input_scale = None
    if isinstance(parts[0][0], Fp8Linear) and parts[0][0].input_scale is not None:
        input_scale = torch.stack(
            [
                torch.stack([x.input_scale.float().reshape(()) for x in layers]).amax()
                for layers in parts
            ]
        )
    return W8A8Experts(weight=weight, weight_scale=scale.contiguous(), input_scale=input_scale)


def _stack_blocks(
    block: str, proj: str, parts: list[tuple[Fp8BlockLinear, ...]]
) -> Fp8BlockExperts:
    first = parts[0][0]
    bn, bk = first.block
    if any(layer.block != first.block for layers in parts for layer in layers):
        raise ValueError(f"{block}: the experts' {proj} projections differ in weight blocks")
    for layers in parts:
        for layer in layers[:-1]:  # every part but the last must end on a block boundary
            if layer.out_features % bn:
                raise ValueError(
                    f"{block}: {proj} concatenates projections of {layer.out_features} rows, "
                    f"not a multiple of the weight block's {bn}: their block scales cannot "
                    "share one grid"
                )
    weight = torch.stack([torch.cat([x.weight for x in layers]) for layers in parts])
    scale = torch.stack([torch.cat([x.weight_scale for x in layers]) for layers in parts])
    return Fp8BlockExperts(weight, scale.float().contiguous(), bn, bk)


def quantize_experts_fp8(gate_up: torch.Tensor, down: torch.Tensor) -> QuantizedExperts:
    """Online FP8 of stacked float experts: per output channel, activations per token."""

    def fp8(w: torch.Tensor) -> W8A8Experts:
        e, n, k = w.shape
        weight, scale = quantize_fp8_per_channel(w.reshape(e * n, k))
        return W8A8Experts(weight.reshape(e, n, k), scale.reshape(e, n, 1), None)

    return QuantizedExperts(fp8(gate_up), fp8(down))

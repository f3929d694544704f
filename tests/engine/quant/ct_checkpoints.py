"""Tiny random Llama checkpoints quantized and compressed by compressed-tensors itself.

compressed-tensors (the library llm-compressor writes its checkpoints with) attaches a scheme to
each Linear, we fill in the scales the way llm-compressor's min-max observers would (the
library's own `calculate_qparams` on each weight's min and max, and on the largest input a
calibration pass saw for static activations), and the library compresses and saves the model:
weight packing, config.json's `quantization_config` and every tensor name are its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils.helpers import (
    calculate_qparams,
    maybe_pad_tensor_for_block_quant,
)
from transformers import AutoModelForCausalLM, GenerationConfig

from tests.tiny_models import BOS, EOS, randomize_weights, tiny_config

GROUP_SIZE = 32  # divides every K here: the tiny model's 64 and 128, SmolLM2's 576 and 1536


def _int_weights(bits: int, symmetric: bool, strategy: str = "group", actorder=None) -> dict:
    return dict(
        weights=QuantizationArgs(
            num_bits=bits,
            type="int",
            strategy=strategy,
            group_size=GROUP_SIZE if strategy == "group" else None,
            symmetric=symmetric,
            dynamic=False,
            actorder=actorder,
        )
    )


def _fp8_block(block_n: int, block_k: int) -> dict:
    """FP8_BLOCK with another block: FP8 weights by [block_n, block_k] tiles, FP8 activations
    dynamic per token and group of block_k (the preset's [128, 128] needs K >= 128)."""
    weights = PRESET_SCHEMES["FP8_BLOCK"]["weights"].model_copy(
        update={"block_structure": [block_n, block_k]}
    )
    inputs = PRESET_SCHEMES["FP8_BLOCK"]["input_activations"].model_copy(
        update={"group_size": block_k}
    )
    return dict(weights=weights, input_activations=inputs)


SCHEMES: dict[str, dict] = {
    "fp8-static": PRESET_SCHEMES["FP8"],  # per-tensor weights, static per-tensor inputs
    "fp8-dynamic": PRESET_SCHEMES["FP8_DYNAMIC"],  # per-channel weights, per-token inputs
    "int8-w8a8": PRESET_SCHEMES["W8A8"],  # per-channel int8 weights, per-token int8 inputs
    "w4a16": _int_weights(4, symmetric=True),
    "w4a16-asym": _int_weights(4, symmetric=False),
    "w8a16": _int_weights(8, symmetric=True),
    "w4a16-channel": _int_weights(4, symmetric=True, strategy="channel"),
    "fp8-block": _fp8_block(32, 32),  # block FP8 W8A8 (DeepSeek-V3, Qwen3-*-FP8) for K = 64
    "fp8-block-n48": _fp8_block(48, 32),  # partial blocks along N (64 = 48 + 16 rows)
}
# Not in SCHEMES (K must be a multiple of 128): the preset itself, for wide_config() models.
WIDE_SCHEMES = {"fp8-block-128": PRESET_SCHEMES["FP8_BLOCK"]}


def wide_config():
    """llama-gqa's config with every K a multiple of 128 (hidden 128, intermediate 256), for
    the FP8_BLOCK preset's [128, 128] blocks and groups of 128."""
    config = tiny_config("llama-gqa")
    config.hidden_size, config.intermediate_size = 128, 256
    config.head_dim = 128 // config.num_attention_heads
    return config


def build_ct_checkpoint(
    scheme: str,
    path: Path,
    seed: int = 0,
    ignore: tuple[str, ...] = ("lm_head",),
    config=None,
    more_groups: dict[str, list[str]] | None = None,
) -> Path:
    """Save a tiny random Llama (llama-gqa's shape, or `config`) quantized with `scheme` (see
    SCHEMES) as compressed-tensors writes it; the layers in `ignore` stay in float;
    `more_groups` adds groups {scheme: targets} after it (the library picks a layer's group)."""
    config = tiny_config("llama-gqa") if config is None else config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    return quantize_and_save(model, scheme, path, seed, ignore, more_groups=more_groups)


def quantize_and_save(
    model,
    scheme: str,
    path: Path,
    seed: int = 0,
    ignore: tuple[str, ...] = ("lm_head",),
    before_compressing: Callable[[torch.nn.Module], None] | None = None,
    more_groups: dict[str, list[str]] | None = None,
) -> Path:
    """Quantize a transformers model in place with `scheme` (and `more_groups`) and save it
    compressed; `before_compressing` sees the calibrated, frozen (fake-quantizing) model."""
    schemes = {**SCHEMES, **WIDE_SCHEMES}
    groups = {"group_0": QuantizationScheme(targets=["Linear"], **schemes[scheme])}
    for i, (name, targets) in enumerate((more_groups or {}).items(), start=1):
        groups[f"group_{i}"] = QuantizationScheme(targets=targets, **schemes[name])
    config = QuantizationConfig(config_groups=groups, ignore=list(ignore))
    apply_quantization_config(model, config)
    _calibrate(model, seed)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            module.quantization_status = QuantizationStatus.FROZEN
    if before_compressing is not None:
        before_compressing(model)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    path = Path(path)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return path


@torch.no_grad()
def _calibrate(model, seed: int) -> None:
    """Weight scales from each weight's min and max; static input scales from a forward pass
    over random tokens (the largest input each layer saw)."""
    seen: dict[torch.nn.Module, torch.Tensor] = {}
    hooks = []
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w = module.weight.data
        lo, hi = _weight_range(w, scheme.weights)
        scale, zero = calculate_qparams(lo, hi, scheme.weights)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape_as(
            module.weight_scale
        )
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape_as(
                module.weight_zero_point
            )
        acts = scheme.input_activations
        if acts is not None and not acts.dynamic:

            def record(mod, args):
                peak = args[0].abs().amax()
                seen[mod] = torch.maximum(seen.get(mod, peak), peak)

            hooks.append(module.register_forward_pre_hook(record))
    if hooks:
        g = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(3, model.config.vocab_size, (4, 32), generator=g)
        for module in model.modules():
            module.quantization_enabled = False
        model(ids)
        for module in model.modules():
            module.quantization_enabled = True
        for hook in hooks:
            hook.remove()
        for module, peak in seen.items():
            args = module.quantization_scheme.input_activations
            scale, _ = calculate_qparams(-peak.reshape(1), peak.reshape(1), args)
            module.input_scale.data = scale.to(module.input_scale.dtype).reshape_as(
                module.input_scale
            )


def _weight_range(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "tensor":
        return w.amin(), w.amax()
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        grouped = w.reshape(w.shape[0], -1, args.group_size)
        return grouped.amin(-1), grouped.amax(-1)
    if args.strategy == "block":  # partial blocks padded with zeros, as the library does
        bn, bk = args.block_structure
        padded = maybe_pad_tensor_for_block_quant(w, args.block_structure)
        tiles = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        return tiles.amin((1, 3)), tiles.amax((1, 3))
    raise ValueError(f"no calibration for weight strategy {args.strategy}")


def reference_model(path: Path):
    """transformers' float32 model of a compressed-tensors checkpoint, dequantized by
    compressed-tensors. transformers loads every scheme here itself except packed weights with
    zero points (it sizes the packed zero points as unpacked ones and refuses the file); for
    those, the library's own PackedQuantizationCompressor dequantizes each layer into a plain
    transformers Llama."""
    import json

    from compressed_tensors.compressors import PackedQuantizationCompressor
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tests.reference import hf_model

    qc = QuantizationConfig.model_validate(
        json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    )
    scheme = qc.config_groups["group_0"]
    if qc.format != "pack-quantized" or scheme.weights.symmetric:
        return hf_model(path)
    state = load_file(str(Path(path) / "model.safetensors"))
    for layer in sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")}):
        local = {
            k[len(layer) + 1 :]: state.pop(k) for k in list(state) if k.startswith(layer + ".")
        }
        state[layer + ".weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()

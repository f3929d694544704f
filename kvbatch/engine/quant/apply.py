"""Swap a freshly built model's nn.Linear layers for quantized ones, taking each layer's
tensors out of the checkpoint's state dict; and refuse quantized tensors that no layer took.

The model is built on the meta device; a quantized layer arrives with real tensors, and the
loader then fills in whatever is still on meta (embeddings, norms, float layers) as before.
"""

from __future__ import annotations

import torch
from torch import nn

from kvbatch.engine.quant.awq import load_awq_linear
from kvbatch.engine.quant.compressed_tensors import load_ct_linear
from kvbatch.engine.quant.detect import UnsupportedQuantization
from kvbatch.engine.quant.fp8_checkpoint import load_fp8_linear, quantize_linear_fp8
from kvbatch.engine.quant.gptq import load_gptq_linear
from kvbatch.engine.quant.layer_tensors import CheckpointFormatError, LayerTensors
from kvbatch.engine.quant.linear import QuantLinear
from kvbatch.engine.quant.scheme import QuantConfig

# Never quantized here: the output projection, and a mixture-of-experts model's routers (the
# block's `gate`, Qwen2-MoE's `shared_expert_gate`), which vLLM keeps in float as well: their
# few weights pick the experts, and checkpoints leave them in float without always saying so.
KEPT_IN_FLOAT = ("lm_head",)
ROUTER_SUFFIXES = (".mlp.gate", ".mlp.shared_expert_gate")
# Suffixes that only quantized checkpoints have: left over after loading, they mean the
# checkpoint is quantized in a way config.json does not say (or a layer was skipped).
QUANT_SUFFIXES = (
    "weight_scale",
    "weight_scale_inv",
    "input_scale",
    "weight_zero_point",
    "input_zero_point",
    "weight_packed",
    "weight_shape",
    "weight_g_idx",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    # attention (query) and KV zero points, and the FP4 formats' global scales: quantization
    # the engine does not run, left behind by a config that named it in a way not caught earlier
    "q_scale",
    "q_zero_point",
    "k_zero_point",
    "v_zero_point",
    "weight_global_scale",
    "input_global_scale",
)


def quantize_linears(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor],
    quant: QuantConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> list[str]:
    """Replace every nn.Linear that `quant` gives a scheme; pop its tensors from
    `state_dict`. Returns the names of the layers replaced."""
    replaced = []
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, module in linears:
        if name in KEPT_IN_FLOAT or name.endswith(ROUTER_SUFFIXES):
            _check_kept_in_float(name, state_dict, quant)
            continue
        if quant.scheme_for(name) is None:
            continue
        prefix = name + "."
        tensors = {
            k[len(prefix) :]: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefix)
        }
        t = LayerTensors(name, format_name(quant), tensors)
        layer = load_quantized_linear(t, quant, dtype, device)
        _check_shape(t, layer, module)
        layer.prepare(dtype)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        replaced.append(name)
    return replaced


def reject_quantized_leftovers(
    state_dict: dict[str, torch.Tensor], quant: QuantConfig | None
) -> None:
    """Fail on quantized tensors no layer took: scales, packed weights, or int/FP8 weights
    that would otherwise be cast to float and read as plain weights."""
    odd = sorted(
        k
        for k, v in state_dict.items()
        if k.rsplit(".", 1)[-1] in QUANT_SUFFIXES
        or not (v.is_floating_point() and v.element_size() >= 2)
    )
    if not odd:
        return
    # a tied lm_head (the model has no Linear for it) or an embedding: kept in float here
    head = [k for k in odd if k.split(".")[-2:-1] in (["lm_head"], ["embed_tokens"])]
    if head and quant is not None:
        layers = " and ".join(sorted({k.rsplit(".", 1)[0] for k in head}))
        raise UnsupportedQuantization(
            f"the checkpoint's {layers} is quantized ({', '.join(head)}); supported: lm_head and "
            f"embeddings in float (list them in `ignore` when quantizing with {quant.method}; "
            "with tie_word_embeddings the output projection is the float embedding)"
        )
    shown = ", ".join(f"{k} ({str(state_dict[k].dtype).removeprefix('torch.')})" for k in odd[:4])
    more = f" and {len(odd) - 4} more" if len(odd) > 4 else ""
    if quant is None:
        raise CheckpointFormatError(
            f"the checkpoint holds quantized tensors ({shown}{more}) but config.json has no "
            "quantization_config: add the quantization_config its writer saved (the engine "
            "reads compressed-tensors, fp8, gptq and awq checkpoints)"
        )
    raise CheckpointFormatError(
        f"the checkpoint holds quantized tensors that its quantization_config "
        f"({quant.method}) does not assign to any layer: {shown}{more}"
    )


def _check_kept_in_float(name: str, state_dict: dict, quant: QuantConfig) -> None:
    quantized = [k for k in state_dict if k.startswith(name + ".") and k.endswith(QUANT_SUFFIXES)]
    if quantized:
        raise UnsupportedQuantization(
            f"the checkpoint's {name} is quantized ({', '.join(sorted(quantized))}); "
            f"supported: {name} in float (list it in `ignore` when quantizing with "
            f"{quant.method})"
        )


def load_quantized_linear(
    t: LayerTensors, quant: QuantConfig, dtype: torch.dtype, device: torch.device
) -> QuantLinear:
    """The quantized module of the layer `t` holds, by its scheme and the checkpoint's format,
    on `device` (its float copy for the CPU is not made yet: QuantLinear.prepare)."""
    scheme = quant.scheme_for(t.layer)
    if scheme is None:
        raise ValueError(f"layer {t.layer} is not quantized by the {quant.method} config")
    return _load_layer(t, quant, scheme, dtype, device).to(device)


def _load_layer(t: LayerTensors, quant: QuantConfig, scheme, dtype, device) -> QuantLinear:
    if quant.format == "compressed-tensors":
        return load_ct_linear(t, scheme, dtype)
    if quant.format == "fp8":
        return load_fp8_linear(t, scheme, dtype)
    if quant.format in ("gptq", "gptq_v2"):
        return load_gptq_linear(t, scheme, dtype, zeros_minus_one=quant.format == "gptq")
    if quant.format == "awq":
        return load_awq_linear(t, scheme, dtype)
    if quant.format == "online-fp8":
        return quantize_linear_fp8(t, dtype, device)
    raise ValueError(f"no loader for quantization format {quant.format!r}")


def format_name(quant: QuantConfig) -> str:
    return {"online-fp8": "float (for online FP8)"}.get(quant.format, quant.format)


def _check_shape(t: LayerTensors, layer: QuantLinear, module: nn.Linear) -> None:
    got = (layer.out_features, layer.in_features)
    want = (module.out_features, module.in_features)
    if got != want:
        raise t.error(f"its weight is [out, in] = {list(got)}, the model needs {list(want)}")
    if (layer.bias is None) != (module.bias is None):
        raise t.error("bias " + ("missing" if layer.bias is None else "unexpected"))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as stored for the forward pass (each storage once), not
    counting the float copies a quantized layer keeps for the CPU path."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if t.is_meta or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total

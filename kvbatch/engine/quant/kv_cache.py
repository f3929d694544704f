"""A checkpoint's KV-cache quantization (compressed-tensors' kv_cache_scheme, with per-layer
`self_attn.k_scale` / `v_scale` tensors) onto the engine's attention layers.

The scales are what an FP8 cache divides K and V by before storing them (the library's
calibrated absmax / 448, the convention of KVScales), so:
- with kv_cache_dtype="fp8" an FP8 per-tensor static symmetric scheme is honoured: each layer
  gets its checkpoint's scales (a layer without them is an error naming the tensor); any other
  scheme (int8, per head or channel, asymmetric, dynamic) cannot be stored in the engine's
  cache and is refused;
- with a float cache K and V are kept unquantized, the precision the calibration started from:
  the scheme is not needed to run the model correctly, and the log says it is not applied.
Scales without a scheme (fp8 checkpoints that carry them) are used by an FP8 cache as well.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvbatch.engine.attention.kv_scales import KVScales
from kvbatch.engine.quant.layer_tensors import CheckpointFormatError
from kvbatch.engine.quant.scheme import QuantConfig, UnsupportedQuantization
from kvbatch.kernels.kv_quant import FP8_KV_DTYPE

log = logging.getLogger(__name__)

SUPPORTED_KV_SCHEME = "8-bit float, strategy tensor, static, symmetric (one k/v scale per layer)"


def apply_kv_cache_scales(
    model: nn.Module,
    scales: dict[str, torch.Tensor],
    quant: QuantConfig | None,
    kv_dtype: torch.dtype,
) -> int:
    """Set each attention layer's KVScales from the checkpoint for an FP8 cache; returns how
    many layers got checkpoint scales (0 for a float cache or a checkpoint without any)."""
    scheme = None if quant is None else quant.kv_cache_scheme
    if kv_dtype != FP8_KV_DTYPE:
        if scheme is not None or scales:
            log.info(
                "the checkpoint's KV-cache quantization (%s) is not applied: the KV cache keeps "
                'K and V in %s (kv_cache_dtype="fp8" stores them in E4M3 with its scales)',
                _describe(scheme) if scheme else "k_scale/v_scale tensors",
                str(kv_dtype).removeprefix("torch."),
            )
        return 0
    if scheme is not None:
        check_kv_cache_scheme(scheme)
    if scheme is None and not scales:
        return 0
    layers = model.model.layers
    used = set()
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}.self_attn."
        names = (prefix + "k_scale", prefix + "v_scale")
        missing = [n for n in names if n not in scales]
        if scheme is not None and missing:
            raise CheckpointFormatError(
                f"the checkpoint's kv_cache_scheme ({_describe(scheme)}) needs per-layer "
                f"scales, but {', '.join(missing)} is missing"
            )
        if len(missing) == 2:
            continue
        try:
            layer.self_attn.kv_scales = KVScales.from_checkpoint(*(scales.get(n) for n in names))
        except ValueError as e:
            raise CheckpointFormatError(f"layer {i}'s KV-cache scales: {e}") from e
        used.update(n for n in names if n in scales)
    unused = sorted(set(scales) - used)
    if unused:
        raise CheckpointFormatError(
            f"KV-cache scales for no attention layer of the model: {', '.join(unused[:4])}"
        )
    return len({n.rsplit(".", 2)[0] for n in used})


def check_kv_cache_scheme(scheme: dict) -> None:
    """Refuse a KV-cache scheme an FP8 cache with one scale per layer cannot store."""
    kind = (scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy"))
    if kind != ("float", 8, "tensor") or scheme.get("dynamic") or not scheme.get("symmetric"):
        raise UnsupportedQuantization(
            f"the checkpoint's kv_cache_scheme ({_describe(scheme)}) cannot be stored in the "
            f'FP8 KV cache (kv_cache_dtype="fp8"); supported: {SUPPORTED_KV_SCHEME}; or run '
            'with kv_cache_dtype="auto", which keeps K and V unquantized'
        )


def _describe(scheme: dict) -> str:
    dynamic = scheme.get("dynamic")
    return (
        f"{scheme.get('num_bits')}-bit {scheme.get('type')} by {scheme.get('strategy')}, "
        f"{'dynamic' if dynamic else 'static'}, "
        f"{'symmetric' if scheme.get('symmetric', True) else 'asymmetric'}"
    )

"""Read a checkpoint's `quantization_config` (config.json) into a QuantConfig, before any
weight is read, or fail with one message that names the method and what is supported.

Supported, as their writers name them:
- compressed-tensors (llm-compressor; ct_config.py reads it): `float-quantized` (FP8 weights
  per tensor or channel, activations static per tensor or dynamic per token; or FP8 weights by
  [bn, bk] blocks with activations dynamic per group of bk, the FP8_BLOCK preset),
  `int-quantized` (INT8 W8A8: channel weights, dynamic per-token activations), `pack-quantized`
  (4/8-bit integer weights by group or channel, symmetric or with zero points, act-order
  allowed; float activations); several groups, the most specific target winning; sparsity
  stored dense; rotations fused into the weights; an FP8 per-tensor kv_cache_scheme
  (kv_cache.py). Refused: NVFP4/MXFP4 and other formats, compressed sparsity (2:4, bitmask),
  online rotations, fake-quantized (not compressed) weights, asymmetric or per-group
  activations, static INT8 activations, class targets other than Linear, quantized embeddings;
- `fp8` (FP8 weights with weight_scale; input_scale when activation_scheme is static; or with
  `weight_block_size` [bn, bk], DeepSeek-V3's and Qwen3-*-FP8's block-wise layout:
  weight_scale_inv per block, activations dynamic per group of bk);
- `gptq` (4/8 bits, any group size, act-order g_idx, symmetric or not; v1 and v2 zero points;
  optimum's modules_in_block_to_quantize). Refused: 2/3 bits, Marlin or other repacked
  checkpoint formats, a quantized lm_head, pack_dtype other than int32, per-module overrides;
- `awq` (4 bits, the GEMM layout, with zero points). Refused: GEMV, GEMV-fast, Marlin and
  ExLlama versions, no zero points;
- `mxfp4` (gpt-oss's experts as published: mxfp4.py; every other layer float).
Every other quant_method (bitsandbytes, hqq, eetq, torchao, quark, exl2/exl3, marlin,
aqlm, vptq, higgs, fbgemm_fp8, modelopt, ...) is refused by name.
`quantization="fp8"` on an unquantized checkpoint quantizes it at load (online FP8).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvbatch.engine.quant.ct_config import block_size, read_compressed_tensors
from kvbatch.engine.quant.mxfp4 import MXFP4_METHOD, read_mxfp4_config
from kvbatch.engine.quant.scheme import (
    WNA16,
    Fp8BlockW8A8,
    Fp8W8A8,
    LayerRule,
    QuantConfig,
    UnsupportedQuantization,
)

__all__ = ["SUPPORTED", "UnsupportedQuantization", "detect_quantization"]

SUPPORTED = (
    "compressed-tensors (float-quantized FP8 incl. block-wise, int-quantized INT8 W8A8, "
    "pack-quantized 4/8-bit weight-only; FP8 per-tensor kv_cache_scheme), fp8 (incl. "
    "weight_block_size), gptq (4/8-bit, gptq/gptq_v2 format), awq (4-bit GEMM), mxfp4 "
    "(gpt-oss experts)"
)
ONLINE_METHODS = ("fp8",)
_DEFAULT_IGNORE = ("lm_head",)  # never quantized by our loader unless a rule names it


def detect_quantization(
    hf_config: Mapping | None, quantization: str | None = None
) -> QuantConfig | None:
    """The checkpoint's quantization from config.json's dict, or the online method asked for
    with `quantization` ("fp8"), or None for a float model."""
    qc = (hf_config or {}).get("quantization_config")
    if qc is None:
        return _online(quantization)
    if not isinstance(qc, Mapping):
        raise UnsupportedQuantization(f"config.json's quantization_config is not an object: {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    readers = {
        "compressed-tensors": read_compressed_tensors,
        "fp8": _fp8,
        "gptq": _gptq,
        "awq": _awq,
        MXFP4_METHOD: read_mxfp4_config,
    }
    if method not in readers:
        raise UnsupportedQuantization(
            f"quantization method {method or 'unnamed'!r} is not supported; supported: {SUPPORTED}"
        )
    quant = readers[method](qc)
    if quant is None:  # nothing quantized after all (e.g. compressed-tensors' dense sparsity)
        return _online(quantization)
    if quantization is not None and quantization != method:
        raise UnsupportedQuantization(
            f"quantization={quantization!r} was asked for, but the checkpoint is already "
            f"quantized with {method!r}: drop the quantization option to use its own weights"
        )
    return quant


def _online(quantization: str | None) -> QuantConfig | None:
    if quantization is None:
        return None
    if quantization not in ONLINE_METHODS:
        raise UnsupportedQuantization(
            f"quantization={quantization!r} is not supported for a float checkpoint; "
            f"supported: {', '.join(ONLINE_METHODS)} (pre-quantized checkpoints need no option)"
        )
    rule = LayerRule(("Linear",), Fp8W8A8(per_channel_weights=True, static_input_scale=False))
    return QuantConfig("fp8", "online-fp8", (rule,), ignore=_DEFAULT_IGNORE)


def _fp8(qc: Mapping) -> QuantConfig:
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise UnsupportedQuantization(
            f"fp8 activation_scheme {act!r} is not supported; supported: dynamic, static"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantization(f"fp8 fmt {fmt!r} is not supported; supported: e4m3")
    block = qc.get("weight_block_size")
    if block is not None:
        scheme = _fp8_block_scheme(block, act)
    else:
        # per_channel_weights is only a default: the loader reads the scale's shape
        scheme = Fp8W8A8(per_channel_weights=False, static_input_scale=act == "static")
    ignore = tuple(qc.get("ignored_layers") or ()) + tuple(qc.get("modules_to_not_convert") or ())
    return QuantConfig(
        "fp8", "fp8", (LayerRule(("Linear",), scheme),), ignore=ignore + ("lm_head",)
    )


def _fp8_block_scheme(block, act: str) -> Fp8BlockW8A8:
    def unsupported(why: str) -> UnsupportedQuantization:
        return UnsupportedQuantization(
            f"fp8 with weight_block_size={block!r}: {why}; supported: two positive block sizes "
            "[bn, bk] with activation_scheme dynamic (per token and group of bk)"
        )

    if act != "dynamic":
        raise unsupported(f"activation_scheme {act!r}")
    return Fp8BlockW8A8(*block_size(block, unsupported))


def _gptq(qc: Mapping) -> QuantConfig:
    bits, group = qc.get("bits"), qc.get("group_size", -1)
    if bits not in (4, 8):
        raise UnsupportedQuantization(
            f"gptq with {bits}-bit weights is not supported; supported: 4 and 8 bits"
        )
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):  # AutoGPTQ's flag for its Marlin-repacked checkpoints
        fmt = "marlin"
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(
            f"gptq checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2"
        )
    if qc.get("dynamic"):
        raise UnsupportedQuantization("gptq per-module overrides ('dynamic') are not supported")
    if qc.get("lm_head"):
        raise UnsupportedQuantization(
            "gptq with a quantized lm_head (lm_head: true) is not supported; supported: "
            "lm_head in float"
        )
    pack_dtype = str(qc.get("pack_dtype") or "int32").removeprefix("torch.")
    if pack_dtype != "int32":
        raise UnsupportedQuantization(
            f"gptq pack_dtype {pack_dtype!r} is not supported; supported: int32"
        )
    scheme = WNA16(
        bits=bits,
        group_size=None if group in (-1, None) else int(group),
        symmetric=bool(qc.get("sym", True)),
        act_order=bool(qc.get("desc_act", False)),
    )
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return QuantConfig(
        "gptq",
        "gptq_v2" if fmt == "gptq_v2" else "gptq",
        (LayerRule(_gptq_targets(qc), scheme),),
        ignore=ignore,
    )


def _gptq_targets(qc: Mapping) -> tuple[str, ...]:
    """Every linear layer, or only those `modules_in_block_to_quantize` names (optimum's list
    of lists of names inside each decoder layer, e.g. "self_attn.q_proj")."""
    blocks = qc.get("modules_in_block_to_quantize")
    if not blocks:
        return ("Linear",)
    names = [n for block in blocks for n in ([block] if isinstance(block, str) else block)]
    return tuple(f"re:.*\\.layers\\.\\d+\\.{re.escape(n)}$" for n in names)


def _awq(qc: Mapping) -> QuantConfig:
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise UnsupportedQuantization(
            f"awq {bits}-bit {version!r} is not supported; supported: 4-bit, version 'gemm'"
        )
    if not qc.get("zero_point", True):
        raise UnsupportedQuantization("awq without zero points is not supported")
    scheme = WNA16(bits=4, group_size=None if group in (-1, None) else int(group), symmetric=False)
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return QuantConfig("awq", "awq", (LayerRule(("Linear",), scheme),), ignore=ignore)

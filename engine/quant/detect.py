"""Read a checkpoint's `quantization_config` (config.json) into a QuantConfig, before any
weight is read, or fail with one message that names the method and what is supported.

Supported, as their writers name them:
- compressed-tensors (llm-compressor): `float-quantized` (FP8 weights per tensor or channel,
  activations static per tensor or dynamic per token; or FP8 weights by [bn, bk] blocks with
  activations dynamic per group of bk, the FP8_BLOCK preset), `int-quantized` (INT8 W8A8: channel
  weights, dynamic per-token activations), `pack-quantized` (4/8-bit integer weights by group
  or channel, symmetric or with zero points, act-order allowed; float activations);
- `fp8` (FP8 weights with weight_scale; input_scale when activation_scheme is static; or with
  `weight_block_size` [bn, bk], DeepSeek-V3's and Qwen3-*-FP8's block-wise layout:
  weight_scale_inv per block, activations dynamic per group of bk);
- `gptq` (4/8 bits, any group size, act-order g_idx, symmetric or not; v1 and v2 zero points);
- `awq` (4 bits, the GEMM layout, with zero points).
`quantization="fp8"` on an unquantized checkpoint quantizes it at load (online FP8).
"""

from __future__ import annotations

from collections.abc import Mapping

from kvbatch.engine.quant.scheme import (
    WNA16,
    Fp8BlockW8A8,
    Fp8W8A8,
    Int8W8A8,
    LayerRule,
    LinearScheme,
    QuantConfig,
)

SUPPORTED = (
    "compressed-tensors (float-quantized FP8 incl. block-wise, int-quantized INT8 W8A8, "
    "pack-quantized 4/8-bit weight-only), fp8 (incl. weight_block_size), gptq (4/8-bit), "
    "awq (4-bit GEMM)"
)
ONLINE_METHODS = ("fp8",)
_DEFAULT_IGNORE = ("lm_head",)  # never quantized by our loader unless a rule names it


class UnsupportedQuantization(ValueError):
    """A checkpoint (or a `quantization=` choice) the engine cannot run correctly."""


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
    if quantization is not None and quantization not in (method, None):
        raise UnsupportedQuantization(
            f"quantization={quantization!r} was asked for, but the checkpoint is already "
            f"quantized with {method!r}: drop the quantization option to use its own weights"
        )
    readers = {
        "compressed-tensors": _compressed_tensors,
        "fp8": _fp8,
        "gptq": _gptq,
        "awq": _awq,
    }
    if method not in readers:
        raise UnsupportedQuantization(
            f"quantization method {method or 'unnamed'!r} is not supported; supported: {SUPPORTED}"
        )
    return readers[method](qc)


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


def _compressed_tensors(qc: Mapping) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantization("compressed-tensors quantization_config has no config_groups")
    if qc.get("sparsity_config"):
        raise UnsupportedQuantization(
            "compressed-tensors sparsity (sparsity_config) is not supported; supported: "
            f"{SUPPORTED}"
        )
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise UnsupportedQuantization(
            f"compressed-tensors quantization_status {status!r} is not supported: save the "
            "model compressed (llm-compressor's save_compressed=True)"
        )
    rules = []
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        scheme = _ct_scheme(name, fmt, group.get("weights"), group.get("input_activations"))
        if group.get("output_activations"):
            raise UnsupportedQuantization(
                f"compressed-tensors group {name!r}: output activation quantization is not "
                "supported"
            )
        rules.append(LayerRule(tuple(group.get("targets") or ()), scheme))
    return QuantConfig(
        "compressed-tensors",
        "compressed-tensors",
        tuple(rules),
        ignore=tuple(qc.get("ignore") or ()),
        kv_cache_scheme=qc.get("kv_cache_scheme"),
    )


_CT_SUPPORTED = (
    "float-quantized 8-bit float weights (tensor/channel) with static tensor or dynamic token "
    "activations, or by [bn, bk] blocks with dynamic activations by groups of bk; int-quantized 8-bit symmetric channel weights with dynamic token "
    "activations; pack-quantized 4/8-bit int weights (group/channel) without activation "
    "quantization"
)


def _ct_scheme(name: str, fmt: str | None, weights, inputs) -> LinearScheme:
    def unsupported(why: str) -> UnsupportedQuantization:
        return UnsupportedQuantization(
            f"compressed-tensors group {name!r} (format {fmt!r}): {why}; supported: {_CT_SUPPORTED}"
        )

    if not weights:
        raise unsupported("no weight quantization")
    w_type, w_bits, w_strategy = (
        weights.get("type"),
        weights.get("num_bits"),
        weights.get("strategy"),
    )
    if weights.get("dynamic"):
        raise unsupported("dynamic weight quantization")
    if fmt == "float-quantized" and w_strategy == "block":
        return _ct_block_scheme(weights, inputs, unsupported)
    if fmt == "float-quantized":
        if (w_type, w_bits) != ("float", 8) or w_strategy not in ("tensor", "channel"):
            raise unsupported(f"{w_bits}-bit {w_type} weights by {w_strategy}")
        if inputs is None:
            raise unsupported("FP8 weights without activation quantization (FP8 weight-only)")
        if (inputs.get("type"), inputs.get("num_bits")) != ("float", 8):
            raise unsupported(f"{inputs.get('num_bits')}-bit {inputs.get('type')} activations")
        static = _activation_kind(inputs, unsupported)
        return Fp8W8A8(per_channel_weights=w_strategy == "channel", static_input_scale=static)
    if fmt == "int-quantized":
        ok = (w_type, w_bits, w_strategy) == ("int", 8, "channel") and weights.get("symmetric")
        if not ok:
            raise unsupported(f"{w_bits}-bit {w_type} weights by {w_strategy}")
        if inputs is None or (inputs.get("type"), inputs.get("num_bits")) != ("int", 8):
            raise unsupported("int weights without 8-bit int activations")
        if _activation_kind(inputs, unsupported) or not inputs.get("symmetric", True):
            raise unsupported("static or asymmetric int8 activations")
        return Int8W8A8()
    if fmt == "pack-quantized":
        if w_type != "int" or w_bits not in (4, 8) or w_strategy not in ("group", "channel"):
            raise unsupported(f"{w_bits}-bit {w_type} weights by {w_strategy}")
        if inputs is not None:
            raise unsupported("activation quantization with packed weights")
        actorder = weights.get("actorder")
        if actorder not in (None, "group", "weight", False):
            raise unsupported(f"actorder {actorder!r}")
        return WNA16(
            bits=w_bits,
            group_size=weights.get("group_size") if w_strategy == "group" else None,
            symmetric=bool(weights.get("symmetric", True)),
            act_order=actorder == "group",
        )
    raise unsupported("this format is not supported")


def _ct_block_scheme(weights, inputs, unsupported) -> Fp8BlockW8A8:
    """FP8_BLOCK: symmetric FP8 weights by [bn, bk] blocks, FP8 activations dynamic per group
    of bk along K (the group a K block of the GEMM needs: one activation scale per row)."""
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or not weights.get(
        "symmetric", True
    ):
        raise unsupported(f"{weights.get('num_bits')}-bit {weights.get('type')} block weights")
    block_n, block_k = _block_size(weights.get("block_structure"), unsupported)
    if inputs is None:
        raise unsupported("block FP8 weights without activation quantization (weight-only)")
    kind = (inputs.get("type"), inputs.get("num_bits"), inputs.get("strategy"))
    if kind != ("float", 8, "group") or inputs.get("dynamic") is not True:
        raise unsupported(
            f"block FP8 weights with {'dynamic' if inputs.get('dynamic') else 'static'} "
            f"{inputs.get('num_bits')}-bit {inputs.get('type')} activations by "
            f"{inputs.get('strategy')}"
        )
    if inputs.get("group_size") != block_k or not inputs.get("symmetric", True):
        raise unsupported(
            f"activation groups of {inputs.get('group_size')} with weight blocks of "
            f"[{block_n}, {block_k}] (symmetric groups of the block's K, {block_k}, are)"
        )
    return Fp8BlockW8A8(block_n, block_k)


def _block_size(block, unsupported) -> tuple[int, int]:
    ok = (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)
    )
    if not ok:
        raise unsupported(f"weight block size {block!r} (two positive integers [bn, bk] are)")
    return int(block[0]), int(block[1])


def _activation_kind(inputs, unsupported) -> bool:
    """True for a static per-tensor scale, False for dynamic per-token scales."""
    strategy, dynamic = inputs.get("strategy"), inputs.get("dynamic")
    if strategy == "token" and dynamic is True:
        return False
    if strategy == "tensor" and dynamic is False:
        return True
    raise unsupported(f"{'dynamic' if dynamic else 'static'} activations by {strategy}")


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
    ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
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
    return Fp8BlockW8A8(*_block_size(block, unsupported))


def _gptq(qc: Mapping) -> QuantConfig:
    bits, group = qc.get("bits"), qc.get("group_size", -1)
    if bits not in (4, 8):
        raise UnsupportedQuantization(
            f"gptq with {bits}-bit weights is not supported; supported: 4 and 8 bits"
        )
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(
            f"gptq checkpoint_format {fmt!r} is not supported; supported: gptq, gptq_v2"
        )
    if qc.get("dynamic"):
        raise UnsupportedQuantization("gptq per-module overrides ('dynamic') are not supported")
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
        (LayerRule(("Linear",), scheme),),
        ignore=ignore,
    )


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

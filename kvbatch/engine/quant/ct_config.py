"""compressed-tensors' `quantization_config` (as llm-compressor writes it) into a QuantConfig,
or one error that names the feature and what is supported.

The library's own reading is the reference: QuantizationArgs' defaults (type int, 8 bits,
symmetric, static, the strategy inferred from group_size when absent) and aliases (actorder
"static" is "weight", "dynamic" is "group"); a group written as a preset name with a list of
targets is refused rather than guessed. What else a config may carry is checked before the
groups, because each changes what the stored weights mean:

- `sparsity_config`: format "dense" stores every weight as is (zeros included), so the model
  runs as written; a compressed sparsity format (bitmask, 2:4) is refused.
- `transform_config`: rotations fused into the weights offline (locations weight_input /
  weight_output) leave nothing to do at run time; an online one (input, output, q_attn,
  k_cache: QuIP's and SpinQuant's R3/R4) must be applied in the forward pass, which the engine
  does not do, so it is refused.
- `quantization_status` other than "compressed": the weights are fake-quantized floats (format
  "dense") whose forward would quantize them again with the stored scales; running them as
  plain floats would skip that, so they are refused.
- `moe_sparsity_config`: a different number of experts per layer; refused.
- `kv_cache_scheme`: kept for the KV cache (kv_cache.py decides what to do with it).
- targets and ignore entries: layer names, "re:" patterns over them (re.match, as the library
  does) and the class "Linear"; any other class name (an attention or embedding class, whose
  quantization the engine does not run) is refused. A layer matched by several groups gets the
  scheme of the most specific target (scheme.py's QuantConfig.scheme_for).
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
    UnsupportedQuantization,
)

CT_SUPPORTED = (
    "float-quantized 8-bit float weights (tensor/channel) with static tensor or dynamic token "
    "symmetric activations, or by [bn, bk] blocks with dynamic activations by groups of bk; "
    "int-quantized 8-bit symmetric channel weights with dynamic symmetric token activations; "
    "pack-quantized 4/8-bit int weights (group/channel) without activation quantization"
)
# Keys the library writes that need no check here (informational, or read elsewhere).
_KNOWN_KEYS = {
    "quant_method",
    "format",
    "config_groups",
    "ignore",
    "quantization_status",
    "kv_cache_scheme",
    "global_compression_ratio",
    "version",
    "sparsity_config",
    "transform_config",
    "moe_sparsity_config",
}
_OFFLINE_TRANSFORMS = ("weight_input", "weight_output")
# The one module class a target may name; any other capitalised target is a class (layer
# names are lower-case, dotted paths).
_LINEAR_CLASS = "Linear"


def read_compressed_tensors(qc: Mapping) -> QuantConfig | None:
    """The QuantConfig of a compressed-tensors quantization_config; None when it quantizes
    nothing the engine must know about (a dense-sparsity or offline-rotated float model)."""
    _check_extras(qc)
    groups = qc.get("config_groups") or {}
    kv_cache_scheme = qc.get("kv_cache_scheme")
    if not groups and not kv_cache_scheme:
        return None  # only dense sparsity or offline rotations: the weights are plain floats
    status = str(qc.get("quantization_status", "compressed")).lower()
    if groups and status != "compressed":
        raise UnsupportedQuantization(
            f"compressed-tensors quantization_status {status!r} (format "
            f"{qc.get('format')!r}): the weights are stored as fake-quantized floats, which the "
            "library's forward quantizes again with their stored scales; running them as "
            "plain floats would not give the quantized model's answers; supported: "
            "checkpoints saved compressed (llm-compressor's save_compressed=True)"
        )
    rules = []
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise UnsupportedQuantization(
                f"compressed-tensors group {name!r} is written as a preset name with targets "
                f"({group!r}); supported: groups that spell out their weights and "
                "input_activations (as the library saves them)"
            )
        fmt = group.get("format") or qc.get("format")
        if group.get("output_activations"):
            raise UnsupportedQuantization(
                f"compressed-tensors group {name!r}: output activation quantization is not "
                "supported"
            )
        targets = tuple(group.get("targets") or ())
        _check_targets(name, targets)
        scheme = ct_scheme(
            name, fmt, args(group.get("weights")), args(group.get("input_activations"))
        )
        rules.append(LayerRule(targets, scheme))
    ignore = tuple(qc.get("ignore") or ())
    return QuantConfig(
        "compressed-tensors",
        "compressed-tensors",
        tuple(rules),
        ignore=ignore,
        kv_cache_scheme=args(kv_cache_scheme),
    )


def args(raw: Mapping | None) -> dict | None:
    """QuantizationArgs as the library reads them: its defaults filled in, strings lower-cased,
    the strategy inferred from group_size when absent, actorder aliases resolved."""
    if raw is None:
        return None
    a = dict(raw)
    a["type"] = str(a.get("type") or "int").lower()
    a["num_bits"] = a.get("num_bits", 8)
    a["symmetric"] = a.get("symmetric", True)
    dynamic = a.get("dynamic", False)
    a["dynamic"] = dynamic.lower() if isinstance(dynamic, str) else dynamic
    strategy, group_size = a.get("strategy"), a.get("group_size")
    if strategy is None:
        if group_size is None:
            strategy = "tensor"
        elif group_size == -1:
            strategy = "channel"
        else:
            strategy = "group"
    a["strategy"] = str(strategy).lower()
    actorder = a.get("actorder")
    if isinstance(actorder, str):
        actorder = {"static": "weight", "dynamic": "group"}.get(actorder.lower(), actorder.lower())
    elif actorder is True:
        actorder = "group"
    a["actorder"] = actorder or None
    return a


def ct_scheme(
    name: str, fmt: str | None, weights: dict | None, inputs: dict | None
) -> LinearScheme:
    """One config group's scheme (weights and input_activations as `args` reads them)."""

    def unsupported(why: str) -> UnsupportedQuantization:
        return UnsupportedQuantization(
            f"compressed-tensors group {name!r} (format {fmt!r}): {why}; supported: {CT_SUPPORTED}"
        )

    if not weights:
        raise unsupported("no weight quantization")
    w_type, w_bits, w_strategy = weights["type"], weights["num_bits"], weights["strategy"]
    if weights["dynamic"]:
        raise unsupported(f"dynamic ({weights['dynamic']}) weight quantization")
    if fmt == "float-quantized" and w_strategy == "block":
        return _block_scheme(weights, inputs, unsupported)
    if fmt == "float-quantized":
        if (w_type, w_bits) != ("float", 8) or w_strategy not in ("tensor", "channel"):
            raise unsupported(f"{w_bits}-bit {w_type} weights by {w_strategy}")
        if not weights["symmetric"]:
            raise unsupported("asymmetric FP8 weights")
        if inputs is None:
            raise unsupported("FP8 weights without activation quantization (FP8 weight-only)")
        if (inputs["type"], inputs["num_bits"]) != ("float", 8):
            raise unsupported(f"{inputs['num_bits']}-bit {inputs['type']} activations")
        static = _activation_kind(inputs, unsupported)
        return Fp8W8A8(per_channel_weights=w_strategy == "channel", static_input_scale=static)
    if fmt == "int-quantized":
        if (w_type, w_bits, w_strategy) != ("int", 8, "channel") or not weights["symmetric"]:
            sym = "symmetric" if weights["symmetric"] else "asymmetric"
            raise unsupported(f"{w_bits}-bit {sym} {w_type} weights by {w_strategy}")
        if inputs is None:
            raise unsupported("int8 weights without activation quantization (W8A16 is stored "
                              "pack-quantized)")  # fmt: skip
        if (inputs["type"], inputs["num_bits"]) != ("int", 8):
            raise unsupported(f"{inputs['num_bits']}-bit {inputs['type']} activations")
        if _activation_kind(inputs, unsupported):
            raise unsupported("static int8 activations by tensor")
        return Int8W8A8()
    if fmt == "pack-quantized":
        if w_type != "int" or w_bits not in (4, 8) or w_strategy not in ("group", "channel"):
            raise unsupported(f"{w_bits}-bit {w_type} weights by {w_strategy}")
        if inputs is not None:
            raise unsupported("activation quantization with packed weights")
        actorder = weights["actorder"]
        if actorder not in (None, "group", "weight"):
            raise unsupported(f"actorder {actorder!r}")
        return WNA16(
            bits=w_bits,
            group_size=weights.get("group_size") if w_strategy == "group" else None,
            symmetric=bool(weights["symmetric"]),
            act_order=actorder == "group",
        )
    if fmt in (None, "dense"):
        raise unsupported(
            "weights stored dense (float weights that the library's forward quantizes with the "
            "stored scales; as plain floats they are not the quantized model)"
        )
    raise unsupported("this format is not supported")


def _block_scheme(weights: dict, inputs: dict | None, unsupported) -> Fp8BlockW8A8:
    """FP8_BLOCK: symmetric FP8 weights by [bn, bk] blocks, FP8 activations dynamic per group
    of bk along K (the group a K block of the GEMM needs: one activation scale per row)."""
    if (weights["type"], weights["num_bits"]) != ("float", 8) or not weights["symmetric"]:
        raise unsupported(f"{weights['num_bits']}-bit {weights['type']} block weights")
    block_n, block_k = block_size(weights.get("block_structure"), unsupported)
    if inputs is None:
        raise unsupported("block FP8 weights without activation quantization (weight-only)")
    kind = (inputs["type"], inputs["num_bits"], inputs["strategy"])
    if kind != ("float", 8, "group") or inputs["dynamic"] is not True:
        raise unsupported(
            f"block FP8 weights with {'dynamic' if inputs['dynamic'] else 'static'} "
            f"{inputs['num_bits']}-bit {inputs['type']} activations by {inputs['strategy']}"
        )
    if inputs.get("group_size") != block_k or not inputs["symmetric"]:
        raise unsupported(
            f"activation groups of {inputs.get('group_size')} with weight blocks of "
            f"[{block_n}, {block_k}] (symmetric groups of the block's K, {block_k}, are)"
        )
    return Fp8BlockW8A8(block_n, block_k)


def block_size(block, unsupported) -> tuple[int, int]:
    """[bn, bk] as two positive ints (the library also accepts the string "128x128")."""
    if isinstance(block, str) and "x" in block:
        parts = block.split("x")
        block = [int(p) for p in parts] if all(p.isdigit() for p in parts) else block
    ok = (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)
    )
    if not ok:
        raise unsupported(f"weight block size {block!r} (two positive integers [bn, bk] are)")
    return int(block[0]), int(block[1])


def _activation_kind(inputs: dict, unsupported) -> bool:
    """True for a static per-tensor scale, False for dynamic per-token scales; both symmetric
    (an asymmetric activation has a zero point the GEMMs do not subtract)."""
    strategy, dynamic = inputs["strategy"], inputs["dynamic"]
    if not inputs["symmetric"]:
        raise unsupported(f"asymmetric {inputs['type']} activations")
    if strategy == "token" and dynamic is True:
        return False
    if strategy == "tensor" and dynamic is False:
        return True
    raise unsupported(f"{'dynamic' if dynamic else 'static'} activations by {strategy}")


def _check_targets(group: str, targets: tuple[str, ...]) -> None:
    if not targets:
        raise UnsupportedQuantization(f"compressed-tensors group {group!r} has no targets")
    for target in targets:
        if target.startswith("re:") or target == _LINEAR_CLASS:
            continue
        if target[:1].isupper():
            raise UnsupportedQuantization(
                f"compressed-tensors group {group!r} targets the module class {target!r}; "
                "supported targets: 'Linear', layer names and 're:' patterns over them (the "
                "engine quantizes only linear layers)"
            )
        if target == "embed_tokens" or target.endswith(".embed_tokens"):
            raise UnsupportedQuantization(
                f"compressed-tensors group {group!r} quantizes the embedding {target!r}; "
                "supported: embeddings in float (only linear layers are quantized)"
            )


def _check_extras(qc: Mapping) -> None:
    """Refuse what changes the meaning of the stored weights (see the module docstring)."""
    sparsity = qc.get("sparsity_config") or {}
    if sparsity:
        fmt = str(sparsity.get("format", "dense")).lower()
        if fmt != "dense":
            raise UnsupportedQuantization(
                f"compressed-tensors sparsity_config format {fmt!r} "
                f"({sparsity.get('sparsity_structure', 'unstructured')} sparsity stored "
                "compressed) is not supported; supported: sparsity stored dense (format "
                "'dense': every weight as is)"
            )
    transforms = qc.get("transform_config") or {}
    for name, scheme in (transforms.get("config_groups") or {}).items():
        for apply in scheme.get("apply") or ():
            location = str(apply.get("location", "")).lower()
            if location not in _OFFLINE_TRANSFORMS:
                raise UnsupportedQuantization(
                    f"compressed-tensors transform_config {name!r} ({scheme.get('type')}) "
                    f"rotates the {location!r} of {apply.get('targets')} at run time (an online "
                    "rotation, as QuIP and SpinQuant's R3/R4 write); supported: rotations fused "
                    "into the weights (locations weight_input and weight_output)"
                )
    if qc.get("moe_sparsity_config"):
        raise UnsupportedQuantization(
            "compressed-tensors moe_sparsity_config (a different number of experts per layer) "
            "is not supported; supported: every layer with the config's num_experts"
        )
    unknown = sorted(
        k for k, v in qc.items() if k not in _KNOWN_KEYS and isinstance(v, Mapping) and v
    )
    if unknown:
        raise UnsupportedQuantization(
            f"compressed-tensors quantization_config has sections the engine does not know: "
            f"{', '.join(unknown)}; supported keys: {', '.join(sorted(_KNOWN_KEYS))}"
        )

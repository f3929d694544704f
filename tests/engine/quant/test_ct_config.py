"""compressed-tensors quantization_configs as the library writes them (its ModelCompressor
saving its own config models), read before any weight: every variant runs as the library means
it or fails naming the feature. Milliseconds each: no weights."""

from __future__ import annotations

import json

import pytest
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.config import BitmaskConfig, DenseSparsityConfig, Sparse24BitMaskConfig
from compressed_tensors.quantization import (
    ActivationOrdering,
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

from kvbatch.engine.quant.ct_config import args
from kvbatch.engine.quant.detect import UnsupportedQuantization, detect_quantization
from kvbatch.engine.quant.scheme import WNA16, Fp8W8A8, Int8W8A8

W4 = WNA16(4, 128, symmetric=True)
FP8_TOKEN = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
FP8_CHANNEL = QuantizationArgs(num_bits=8, type="float", strategy="channel")
INT8_CHANNEL = QuantizationArgs(num_bits=8, type="int", strategy="channel")


def group(preset: str | None = None, targets=("Linear",), **args) -> QuantizationScheme:
    return QuantizationScheme(targets=list(targets), **{**PRESET_SCHEMES.get(preset, {}), **args})


def written(tmp_path, groups=None, fmt=None, transform=None, sparsity=None, **qc) -> dict:
    """config.json as compressed-tensors' ModelCompressor.update_config writes it. A
    sparsity_config goes in as the library wrote it before it stopped saving one (its own
    config model, dumped)."""
    quant = None
    if groups is not None or qc:
        quant = QuantizationConfig(
            config_groups=groups or {},
            format=fmt or "dense",
            quantization_status=qc.pop("quantization_status", "compressed"),
            ignore=["lm_head"],
            **qc,
        )
    (tmp_path / "config.json").write_text("{}")
    ModelCompressor(quantization_config=quant, transform_config=transform).update_config(
        str(tmp_path)
    )
    config = json.loads((tmp_path / "config.json").read_text())
    if sparsity is not None:
        qc = config.setdefault("quantization_config", {"quant_method": "compressed-tensors"})
        qc["sparsity_config"] = sparsity.model_dump()
    return config


def refused(config: dict, *words: str) -> str:
    with pytest.raises(UnsupportedQuantization, match="supported") as info:
        detect_quantization(config)
    for word in words:
        assert word in str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "preset, fmt, words",
    [
        ("NVFP4", "nvfp4-pack-quantized", ["format 'nvfp4-pack-quantized'"]),
        ("NVFP4A16", "nvfp4-pack-quantized", ["format 'nvfp4-pack-quantized'"]),
        ("MXFP4", "mxfp4-pack-quantized", ["format 'mxfp4-pack-quantized'"]),
        ("W4A8", "pack-quantized", ["activation quantization with packed weights"]),
        ("W2A16", "pack-quantized", ["2-bit int"]),
        ("W3A16", "pack-quantized", ["3-bit int"]),
        ("W4AFP8", "pack-quantized", ["activation quantization with packed weights"]),
    ],
)
def test_formats_the_engine_cannot_run_are_refused_by_name(tmp_path, preset, fmt, words):
    refused(written(tmp_path, {"group_0": group(preset)}, fmt), *words)


@pytest.mark.parametrize(
    "scheme, fmt, words",
    [
        # static per-tensor INT8 input scales (the W8A8 SmoothQuant recipe's static variant)
        (
            dict(weights=INT8_CHANNEL, input_activations=QuantizationArgs(strategy="tensor")),
            "int-quantized",
            ["static int8 activations"],
        ),
        (
            dict(
                weights=INT8_CHANNEL,
                input_activations=QuantizationArgs(strategy="token", dynamic=True, symmetric=False),
            ),
            "int-quantized",
            ["asymmetric int activations"],
        ),
        (
            dict(
                weights=FP8_CHANNEL,
                input_activations=FP8_TOKEN.model_copy(update={"symmetric": False}),
            ),
            "float-quantized",
            ["asymmetric float activations"],
        ),
        (
            dict(
                weights=FP8_CHANNEL,
                input_activations=QuantizationArgs(
                    num_bits=8, type="float", strategy="group", group_size=64, dynamic=True
                ),
            ),
            "float-quantized",
            ["dynamic activations by group"],
        ),
        (
            dict(weights=FP8_CHANNEL, input_activations=FP8_TOKEN, output_activations=FP8_TOKEN),
            "float-quantized",
            ["output activation"],
        ),
        # FP8 weight-only: the library stores it naive-quantized
        (dict(weights=FP8_CHANNEL), "naive-quantized", ["format 'naive-quantized'"]),
        # an int8 W8A16 stored int-quantized by a forced format
        (dict(weights=INT8_CHANNEL), "int-quantized", ["int8 weights without activation"]),
        (
            dict(
                weights=INT8_CHANNEL.model_copy(update={"type": "float"}),
                input_activations=FP8_TOKEN,
            ),
            "int-quantized",
            ["8-bit symmetric float weights"],
        ),
        (
            dict(
                weights=QuantizationArgs(num_bits=8, type="int", strategy="channel"),
                input_activations=FP8_TOKEN,
            ),
            "float-quantized",
            ["8-bit int weights by channel"],
        ),
        (
            dict(
                weights=QuantizationArgs(
                    num_bits=4, type="int", strategy="tensor_group", group_size=16, dynamic="local"
                )
            ),
            "pack-quantized",
            ["dynamic (local) weight quantization"],
        ),
    ],
)
def test_activation_and_weight_strategies_the_gemms_do_not_run_are_refused(
    tmp_path, scheme, fmt, words
):
    refused(written(tmp_path, {"group_0": group(**scheme)}, fmt), *words)


def test_float_quantized_with_fewer_than_8_bits_is_refused():
    """A float format of another width (written by hand: the library's own models store 4-bit
    floats only in the FP4 formats)."""
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "g": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "float", "strategy": "channel"},
                    "input_activations": FP8_TOKEN.model_dump(),
                }
            },
        }
    }
    refused(config, "4-bit float weights by channel")


@pytest.mark.parametrize(
    "targets, words",
    [
        (["LlamaAttention"], ["module class 'LlamaAttention'"]),  # attention (q/k/v) quantization
        (["Embedding"], ["module class 'Embedding'"]),
        (["Linear", "model.embed_tokens"], ["embedding 'model.embed_tokens'"]),
    ],
)
def test_targets_other_than_linear_layers_are_refused(tmp_path, targets, words):
    groups = {"group_0": group("FP8_DYNAMIC", targets=targets)}
    refused(written(tmp_path, groups, "float-quantized"), *words)


@pytest.mark.parametrize(
    "sparsity, with_quant",
    [
        (Sparse24BitMaskConfig(), True),
        (Sparse24BitMaskConfig(), False),  # 2:4 sparsity without quantization
        (BitmaskConfig(), False),
    ],
)
def test_compressed_sparsity_is_refused(tmp_path, sparsity, with_quant):
    groups = {"group_0": group("W4A16")} if with_quant else None
    config = written(tmp_path, groups, "pack-quantized" if with_quant else None, sparsity=sparsity)
    refused(config, f"sparsity_config format {sparsity.format!r}")


def test_sparsity_stored_dense_runs_as_written(tmp_path):
    """Format "dense": every weight stored as is, zeros included: the quantized scheme (or the
    float model) reads it unchanged."""
    quant = detect_quantization(
        written(
            tmp_path, {"group_0": group("W4A16")}, "pack-quantized", sparsity=DenseSparsityConfig()
        )
    )
    assert quant.scheme_for("model.layers.0.mlp.up_proj") == W4
    float_only = written(tmp_path, None, sparsity=DenseSparsityConfig(sparsity_structure="2:4"))
    assert float_only["quantization_config"]["sparsity_config"]["format"] == "dense"
    assert detect_quantization(float_only) is None


def rotation(location: str, targets=("Linear",), inverse=False) -> TransformArgs:
    return TransformArgs(targets=list(targets), location=location, inverse=inverse)


# SpinQuant's R1 (the residual stream) and R2 (per head, between v_proj and o_proj): fused
R1_R2 = {
    "R1": TransformScheme(
        type="hadamard",
        apply=[
            rotation("weight_output", ["re:.*embed_tokens$", "re:.*o_proj$", "re:.*down_proj$"]),
            rotation("weight_input", ["re:.*(q|k|v|up|gate)_proj$", "lm_head"], inverse=True),
        ],
    ),
    "R2": TransformScheme(
        type="hadamard",
        head_dim=16,
        apply=[
            rotation("weight_output", ["re:.*v_proj$"]),
            rotation("weight_input", ["re:.*o_proj$"], inverse=True),
        ],
    ),
}
ONLINE = {
    "quip-v": TransformScheme(  # QuIP: the input rotated at run time, its inverse fused
        type="random-hadamard",
        apply=[rotation("input"), rotation("weight_input", inverse=True)],
    ),
    "R3": TransformScheme(
        type="hadamard",
        apply=[rotation("q_attn", ["re:.*self_attn$"]), rotation("k_cache", ["re:.*self_attn$"])],
    ),
    "R4": TransformScheme(
        type="hadamard",
        apply=[
            rotation("input", ["re:.*down_proj$"]),
            rotation("weight_input", ["re:.*down_proj$"], inverse=True),
        ],
    ),
}


def test_rotations_fused_into_the_weights_need_nothing_at_run_time(tmp_path):
    transform = TransformConfig(config_groups=R1_R2)
    config = written(tmp_path, {"group_0": group("W4A16")}, "pack-quantized", transform=transform)
    assert config["quantization_config"]["transform_config"]["config_groups"]["R2"]
    assert detect_quantization(config).scheme_for("model.layers.0.self_attn.o_proj") == W4
    assert detect_quantization(written(tmp_path, None, transform=transform)) is None


@pytest.mark.parametrize("name", sorted(ONLINE))
def test_online_rotations_are_refused(tmp_path, name):
    transform = TransformConfig(config_groups={**R1_R2, name: ONLINE[name]})
    config = written(tmp_path, {"group_0": group("W4A16")}, "pack-quantized", transform=transform)
    refused(config, f"transform_config {name!r}", "online rotation")


def test_fake_quantized_float_weights_are_refused(tmp_path):
    """format "dense" with status "frozen": float weights the library's forward quantizes
    again with the stored scales; as plain floats they would not be the quantized model."""
    config = written(tmp_path, {"group_0": group("W8A8")}, "dense", quantization_status="frozen")
    refused(config, "quantization_status 'frozen'", "fake-quantized")


def test_a_kv_cache_scheme_alone_leaves_the_weights_in_float(tmp_path):
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor")
    quant = detect_quantization(written(tmp_path, None, kv_cache_scheme=kv))
    assert quant.rules == () and quant.scheme_for("model.layers.0.mlp.up_proj") is None
    assert (quant.kv_cache_scheme["type"], quant.kv_cache_scheme["strategy"]) == ("float", "tensor")


def test_the_most_specific_target_wins_as_in_the_library(tmp_path):
    """compressed-tensors picks a layer name over a "re:" pattern over the class "Linear",
    whatever the groups' order."""
    groups = {
        "group_0": group("W4A16", format="pack-quantized"),
        "group_1": group("FP8_DYNAMIC", ["re:.*mlp\\.down_proj$"], format="float-quantized"),
        "group_2": group("W8A8", ["model.layers.1.mlp.down_proj"], format="int-quantized"),
    }
    quant = detect_quantization(written(tmp_path, groups, "mixed-precision"))
    assert quant.scheme_for("model.layers.0.self_attn.q_proj") == W4
    assert quant.scheme_for("model.layers.0.mlp.down_proj") == Fp8W8A8(True, False)
    assert quant.scheme_for("model.layers.1.mlp.down_proj") == Int8W8A8()


def test_the_librarys_defaults_and_aliases_are_read_as_it_reads_them():
    """Older writers leave out what the library defaults (strategy from group_size, symmetric)
    and spell act order "static" / "dynamic"."""
    weights = {"num_bits": 4, "type": "INT", "group_size": 32, "actorder": "static"}
    config = {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": weights}},
        }
    }
    assert detect_quantization(config).scheme_for("x.up_proj") == WNA16(4, 32, True, False)
    weights.update(actorder="dynamic", group_size=-1)
    assert detect_quantization(config).scheme_for("x.up_proj") == WNA16(4, None, True, True)


def test_unknown_sections_and_preset_groups_are_refused():
    base = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    preset = {**base, "config_groups": {"W4A16": ["Linear"]}}
    refused({"quantization_config": preset}, "preset name")
    moe = {
        **base,
        "config_groups": {"g": group("W4A16").model_dump()},
        "moe_sparsity_config": {"method": "prune", "num_experts": [None, 6]},
    }
    refused({"quantization_config": moe}, "moe_sparsity_config")
    other = {**base, "config_groups": {"g": group("W4A16").model_dump()}, "new_feature": {"a": 1}}
    refused({"quantization_config": other}, "new_feature")


def test_quantized_groups_stored_dense_are_refused(tmp_path):
    """A format forced to "dense" keeps float weights next to their scales."""
    refused(written(tmp_path, {"group_0": group("W4A16")}, "dense"), "weights stored dense")


@pytest.mark.parametrize(
    "raw",
    [
        {"num_bits": 4, "group_size": 128},
        {"num_bits": 4, "group_size": -1, "symmetric": False},
        {"type": "FLOAT", "strategy": "TOKEN", "dynamic": True},
        {},
        {"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group",
         "dynamic": "LOCAL"},
        {"num_bits": 8, "strategy": "block", "block_structure": "64x32", "type": "float"},
        {"num_bits": 4, "group_size": 32, "actorder": "static"},
    ],
)  # fmt: skip
def test_args_are_filled_in_as_the_library_fills_them(raw):
    ours = args(raw)
    lib = QuantizationArgs.model_validate(raw)
    for name in ("type", "num_bits", "symmetric", "strategy", "dynamic"):
        assert ours[name] == getattr(lib, name), name
    aliases = ActivationOrdering.get_aliases()  # "static" is "weight"
    assert ours["actorder"] == aliases.get(lib.actorder, lib.actorder)

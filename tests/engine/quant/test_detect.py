"""config.json's quantization_config -> a scheme per layer, or one error naming the method
and what is supported, before any weight is read."""

from __future__ import annotations

import pytest
from transformers.utils.quantization_config import QuantizationMethod

from kvbatch.engine.quant.detect import (
    ONLINE_METHODS,
    UnsupportedQuantization,
    detect_quantization,
)
from kvbatch.engine.quant.mxfp4 import experts_kept_in_float
from kvbatch.engine.quant.scheme import WNA16, Fp8BlockW8A8, Fp8W8A8, Int8W8A8
from kvbatch.engine_args import QUANTIZATION_CHOICES


def ct_config(fmt: str, weights: dict, inputs: dict | None = None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": group}}
    return {"quantization_config": {**qc, **extra}}


FP8_W = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True}
FP8_TOKEN = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
INT8_W = {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True}
INT8_TOKEN = {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True}
FP8_BLOCK_W = {**FP8_W, "strategy": "block", "block_structure": [128, 128]}
FP8_GROUP = {**FP8_TOKEN, "strategy": "group", "group_size": 128, "symmetric": True}
W4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128, "symmetric": False}


def test_a_float_checkpoint_has_no_quantization():
    assert detect_quantization({"architectures": ["LlamaForCausalLM"]}) is None
    assert detect_quantization(None) is None


@pytest.mark.parametrize(
    "config, scheme",
    [
        (ct_config("float-quantized", FP8_W, FP8_TOKEN), Fp8W8A8(True, False)),
        (
            ct_config(
                "float-quantized",
                {**FP8_W, "strategy": "tensor"},
                {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False},
            ),
            Fp8W8A8(False, True),
        ),
        (ct_config("float-quantized", FP8_BLOCK_W, FP8_GROUP), Fp8BlockW8A8(128, 128)),
        (
            ct_config("float-quantized", {**FP8_BLOCK_W, "block_structure": [64, 32]},
                      {**FP8_GROUP, "group_size": 32}),
            Fp8BlockW8A8(64, 32),
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic", "fmt": "e4m3"}},
            Fp8BlockW8A8(128, 128),
        ),
        (ct_config("int-quantized", INT8_W, INT8_TOKEN), Int8W8A8()),
        (ct_config("pack-quantized", W4), WNA16(4, 128, symmetric=False)),
        (
            {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
            Fp8W8A8(False, True),
        ),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 32,
                                     "desc_act": True, "sym": True}},
            WNA16(8, 32, symmetric=True, act_order=True),
        ),
        (
            {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64,
                                     "zero_point": True, "version": "gemm"}},
            WNA16(4, 64, symmetric=False),
        ),
    ],
)  # fmt: skip
def test_supported_configs_give_each_linear_its_scheme(config, scheme):
    quant = detect_quantization(config)
    assert quant.scheme_for("model.layers.3.mlp.down_proj") == scheme
    assert quant.scheme_for("lm_head") is None or quant.method == "compressed-tensors"


def test_ignore_keeps_layers_in_float():
    quant = detect_quantization(
        ct_config("pack-quantized", W4, ignore=["lm_head", "re:.*mlp.gate_proj$"])
    )
    assert quant.scheme_for("lm_head") is None
    assert quant.scheme_for("model.layers.0.mlp.gate_proj") is None
    assert quant.scheme_for("model.layers.0.mlp.up_proj") == WNA16(4, 128, symmetric=False)


def test_the_kv_cache_scheme_is_kept_for_the_kv_cache():
    kv = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
    quant = detect_quantization(ct_config("float-quantized", FP8_W, FP8_TOKEN, kv_cache_scheme=kv))
    assert quant.kv_cache_scheme.items() >= {**kv, "symmetric": True}.items()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes' is not supp"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 3}}, "3-bit"),
        ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}}, "gemv"),
        (
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "weight_block_size": [128, 128],
                    "activation_scheme": "static",
                }
            },
            "activation_scheme 'static'",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
            "weight block size [128]",
        ),
        (
            {
                "quantization_config": {
                    "quant_method": "fp8",
                    "weight_block_size": [128, 128],
                    "fmt": "e5m2",
                }
            },
            "fmt 'e5m2'",
        ),
        (ct_config("float-quantized", FP8_BLOCK_W, FP8_TOKEN), "activations by token"),
        (
            ct_config("float-quantized", FP8_BLOCK_W, {**FP8_GROUP, "group_size": 64}),
            "activation groups of 64",
        ),
        (ct_config("float-quantized", FP8_BLOCK_W, None), "block FP8 weights without"),
        (ct_config("nvfp4-pack-quantized", W4), "format 'nvfp4-pack-quantized'"),
        (ct_config("float-quantized", FP8_W), "FP8 weight-only"),
        (ct_config("float-quantized", {**FP8_W, "strategy": "group"}, FP8_TOKEN), "by group"),
        (ct_config("int-quantized", INT8_W, None), "int8 weights without"),
        (ct_config("pack-quantized", {**W4, "num_bits": 2}), "2-bit int"),
        (ct_config("pack-quantized", W4, FP8_TOKEN), "activation quantization with packed"),
    ],
)
def test_unsupported_formats_fail_naming_what_is_supported(config, message):
    with pytest.raises(UnsupportedQuantization, match="supported") as info:
        detect_quantization(config)
    assert message in str(info.value)


def test_online_fp8_quantizes_every_linear_but_the_lm_head():
    quant = detect_quantization({}, "fp8")
    assert quant.format == "online-fp8"
    assert quant.scheme_for("model.layers.0.self_attn.q_proj") == Fp8W8A8(True, False)
    assert quant.scheme_for("lm_head") is None


def test_online_quantization_of_a_quantized_checkpoint_is_refused():
    with pytest.raises(UnsupportedQuantization, match="already quantized with 'awq'"):
        detect_quantization({"quantization_config": {"quant_method": "awq", "bits": 4}}, "fp8")
    with pytest.raises(UnsupportedQuantization, match="'int4' is not supported.*fp8"):
        detect_quantization({}, "int4")


def test_the_command_line_offers_the_engines_online_methods():
    """engine_args keeps its own copy (it imports no torch); the two must agree."""
    assert QUANTIZATION_CHOICES == ONLINE_METHODS


OWN_READERS = {"compressed-tensors", "fp8", "gptq", "awq", "mxfp4"}


@pytest.mark.parametrize(
    "method", sorted(m.value for m in QuantizationMethod if m.value not in OWN_READERS)
)
def test_every_other_method_transformers_knows_is_refused_by_name(method):
    """bitsandbytes 4/8-bit, hqq, eetq, torchao, quark, aqlm, vptq, higgs,
    fbgemm_fp8, ... each as transformers names it in quant_method."""
    config = {"quantization_config": {"quant_method": method, "bits": 4, "load_in_4bit": True}}
    with pytest.raises(UnsupportedQuantization, match=f"method {method!r} is not supported"):
        detect_quantization(config)


@pytest.mark.parametrize("method", ["exl2", "exl3", "marlin", "modelopt"])
def test_methods_other_tools_write_are_refused_by_name(method):
    with pytest.raises(UnsupportedQuantization, match=f"method {method!r} is not supported"):
        detect_quantization({"quantization_config": {"quant_method": method}})


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"is_marlin_format": True}, "checkpoint_format 'marlin'"),  # AutoGPTQ's flag
        ({"format": "bitblas"}, "checkpoint_format 'bitblas'"),  # GPTQModel's key
        ({"bits": 2}, "2-bit"),
        ({"bits": 3}, "3-bit"),
        ({"lm_head": True}, "quantized lm_head"),
        ({"pack_dtype": "int16"}, "pack_dtype 'int16'"),
        ({"dynamic": {"-:.*down_proj": {}}}, "per-module overrides"),
    ],
)
def test_gptq_variants_the_engine_cannot_run_are_refused(extra, message):
    with pytest.raises(UnsupportedQuantization, match="supported") as info:
        detect_quantization({"quantization_config": {**GPTQ, **extra}})
    assert message in str(info.value)


def test_gptq_variants_that_run():
    v2 = detect_quantization({"quantization_config": {**GPTQ, "format": "gptq_v2", "sym": False}})
    assert v2.format == "gptq_v2"
    assert v2.scheme_for("model.layers.0.mlp.up_proj") == WNA16(4, 128, symmetric=False)
    some = detect_quantization(
        {
            "quantization_config": {
                **GPTQ,
                "modules_in_block_to_quantize": [["self_attn.q_proj"], ["mlp.down_proj"]],
            }
        }
    )
    assert some.scheme_for("model.layers.3.self_attn.q_proj") == WNA16(4, 128, True)
    assert some.scheme_for("model.layers.3.mlp.down_proj") is not None
    assert some.scheme_for("model.layers.3.self_attn.k_proj") is None  # left in float


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"version": "gemv"}, "'gemv'"),
        ({"version": "gemv_fast"}, "'gemv_fast'"),
        ({"version": "marlin"}, "'marlin'"),
        ({"version": "exllama"}, "'exllama'"),
        ({"zero_point": False}, "without zero points"),
        ({"bits": 8}, "8-bit"),
    ],
)
def test_awq_variants_the_engine_cannot_run_are_refused(extra, message):
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    with pytest.raises(UnsupportedQuantization) as info:
        detect_quantization({"quantization_config": {**awq, "version": "gemm", **extra}})
    assert message in str(info.value)


def test_awq_modules_to_not_convert_stay_in_float():
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM"}
    quant = detect_quantization(
        {"quantization_config": {**awq, "modules_to_not_convert": ["mlp.gate"]}}
    )
    assert quant.scheme_for("model.layers.0.mlp.gate") is None
    assert quant.scheme_for("model.layers.0.mlp.gate_proj") == WNA16(4, 128, symmetric=False)


def test_mxfp4_reads_modules_to_not_convert():
    """gpt-oss's config: experts in MXFP4, the listed modules (and every Linear) in float."""
    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "lm_head"]
    quant = detect_quantization(
        {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": keep}}
    )
    assert (quant.method, quant.format, quant.rules) == ("mxfp4", "mxfp4", ())
    assert quant.scheme_for("model.layers.0.self_attn.q_proj") is None
    assert experts_kept_in_float(quant, "model.layers.0.mlp.experts") is False
    assert experts_kept_in_float(
        detect_quantization(
            {"quantization_config": {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.mlp.experts"]}}
        ),
        "model.layers.3.mlp.experts",
    )  # fmt: skip

"""A compressed-tensors checkpoint's kv_cache_scheme: its per-layer k_scale / v_scale reach an
FP8 KV cache's attention layers (they were read and dropped), a float cache keeps K and V
unquantized and says so, and a scheme or a scale the FP8 cache cannot take fails at load.

The checkpoints are the library's own (ct_checkpoints), with the scheme it writes in config.json
and one float32 [1] scale per layer under the names it gives them (`self_attn.k_scale`): the
library cannot calibrate them itself here (it looks for a `past_key_values` argument that this
transformers' attention no longer has)."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from safetensors.torch import load_file, save_file

from kvbatch.engine import LLM
from kvbatch.engine.attention.kv_scales import UNIT_KV_SCALES, KVScales
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.ct_config import args
from kvbatch.engine.quant.kv_cache import apply_kv_cache_scales
from kvbatch.engine.quant.layer_tensors import CheckpointFormatError
from kvbatch.engine.quant.scheme import UnsupportedQuantization
from kvbatch.kernels.kv_quant import FP8_KV_DTYPE

FP8_KV = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
SCALES = {0: (0.03125, 0.015625), 1: (0.0625, 0.046875)}  # layer: (k, v)


def with_kv_scheme(src, dst, scheme: QuantizationArgs, drop: str | None = None):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = scheme.model_dump()
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(str(dst / "model.safetensors"))
    for i, (k, v) in SCALES.items():
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k])
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
    state.pop(drop, None)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def fp8_kv_checkpoint(ct_checkpoints, tmp_path_factory):
    return with_kv_scheme(
        ct_checkpoints("fp8-dynamic"), tmp_path_factory.mktemp("kv") / "c", FP8_KV
    )


def engine_scales(path, kv_cache_dtype: str) -> list[KVScales]:
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_bytes=1 << 20,
              kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    return [layer.self_attn.kv_scales for layer in llm.engine.model.model.layers]


def test_an_fp8_cache_takes_each_layers_checkpoint_scales(fp8_kv_checkpoint):
    assert engine_scales(fp8_kv_checkpoint, "fp8") == [KVScales(*SCALES[i]) for i in (0, 1)]


def test_a_float_cache_keeps_kv_unquantized_and_says_so(fp8_kv_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="kvbatch.engine.quant.kv_cache"):
        assert engine_scales(fp8_kv_checkpoint, "auto") == [UNIT_KV_SCALES] * 2
    assert "KV-cache quantization (8-bit float by tensor, static, symmetric) is not applied" in (
        caplog.text
    )


def test_a_missing_scale_is_named(ct_checkpoints, tmp_path):
    drop = "model.layers.1.self_attn.v_scale"
    path = with_kv_scheme(ct_checkpoints("fp8-dynamic"), tmp_path / "c", FP8_KV, drop=drop)
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    with pytest.raises(CheckpointFormatError, match=f"{drop} is missing"):
        apply_kv_cache_scales(
            loaded.model, loaded.kv_cache_scales, loaded.quantization, FP8_KV_DTYPE
        )


@pytest.fixture(scope="module")
def loaded(fp8_kv_checkpoint):
    return load_model(fp8_kv_checkpoint, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    "scheme, words",
    [
        (QuantizationArgs(num_bits=8, type="int", strategy="tensor"), "8-bit int by tensor"),
        (FP8_KV.model_copy(update={"strategy": "attn_head"}), "by attn_head"),
        (FP8_KV.model_copy(update={"symmetric": False}), "asymmetric"),
    ],
)
def test_schemes_an_fp8_cache_cannot_store_are_refused(loaded, scheme, words):
    quant = replace(loaded.quantization, kv_cache_scheme=args(scheme.model_dump()))
    with pytest.raises(UnsupportedQuantization, match='kv_cache_dtype="auto"') as info:
        apply_kv_cache_scales(loaded.model, loaded.kv_cache_scales, quant, FP8_KV_DTYPE)
    assert words in str(info.value)
    # a float cache needs none of it
    assert apply_kv_cache_scales(loaded.model, loaded.kv_cache_scales, quant, torch.float32) == 0


@pytest.mark.parametrize("legacy", ["kv_scale", "proj_output_scale"])
def test_older_writers_kv_scale_names_reach_the_fp8_cache(ct_checkpoints, tmp_path, legacy):
    """AutoFP8's one `self_attn.kv_scale` for K and V, and llm-compressor's older
    `k_proj.output_scale` / `v_proj.output_scale`, as vLLM reads them (were dropped, then
    refused as tensors without a place)."""
    path = with_kv_scheme(ct_checkpoints("fp8-dynamic"), tmp_path / "c", FP8_KV)
    state = load_file(str(path / "model.safetensors"))
    for i in SCALES:
        prefix = f"model.layers.{i}.self_attn."
        k_scale, v_scale = state.pop(prefix + "k_scale"), state.pop(prefix + "v_scale")
        if legacy == "kv_scale":
            state[prefix + "kv_scale"] = k_scale
        else:
            state[prefix + "k_proj.output_scale"] = k_scale
            state[prefix + "v_proj.output_scale"] = v_scale
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    expected = [KVScales(k, k if legacy == "kv_scale" else v) for k, v in (SCALES[0], SCALES[1])]
    assert engine_scales(path, "fp8") == expected

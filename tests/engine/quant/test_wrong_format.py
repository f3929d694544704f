"""Never silent garbage: each format's tensors fed to the wrong path (no quantization_config, or
config.json naming another format) fail at load with a message naming the layer, the format
and what was found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.detect import UnsupportedQuantization
from kvbatch.engine.quant.layer_tensors import CheckpointFormatError
from tests.engine.model.test_model import prefill_logits
from tests.engine.quant.ct_checkpoints import build_ct_checkpoint, reference_model
from tests.engine.quant.wna16_checkpoints import build_wna16_checkpoint
from tests.tiny_models import tiny_config

CT = "compressed-tensors"


def with_config(src: Path, dst: Path, quantization_config: dict | None) -> Path:
    """A copy of checkpoint `src` whose config.json says `quantization_config` (None: none)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def ct_config(fmt: str, weights: dict, inputs: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    return {"quant_method": CT, "format": fmt, "config_groups": {"g": group}, "ignore": ["lm_head"]}


INT8 = ct_config(
    "int-quantized",
    {"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": True},
    {"type": "int", "num_bits": 8, "strategy": "token", "dynamic": True, "symmetric": True},
)
FP8 = ct_config(
    "float-quantized",
    {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
    {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
)
W4 = ct_config(
    "pack-quantized", {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32}
)
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
FP8_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}


def load(path: Path):
    return load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static", "int8-w8a8", "w4a16"])
def test_quantized_tensors_without_a_quantization_config_fail(ct_checkpoints, tmp_path, scheme):
    """The old silent-garbage path: FP8/int8 weights cast to float, scales ignored."""
    path = with_config(ct_checkpoints(scheme), tmp_path / "ckpt", None)
    with pytest.raises(CheckpointFormatError, match="no quantization_config") as info:
        load(path)
    assert "weight_scale" in str(info.value) or "weight_packed" in str(info.value)


@pytest.mark.parametrize(
    "scheme, claimed, message",
    [
        ("fp8-dynamic", INT8, "weight is float8_e4m3fn, not int8"),
        ("int8-w8a8", FP8, "weight is int8, not float8_e4m3fn"),
        ("fp8-dynamic", W4, "missing weight_packed, weight_shape"),
        ("w4a16", FP8, "missing weight; unexpected weight_packed, weight_shape"),
        ("w4a16", GPTQ, "missing qweight, qzeros, scales"),
        ("fp8-dynamic", FP8_STATIC, "missing input_scale"),
        ("int8-w8a8", AWQ, "missing qweight"),
    ],
)
def test_compressed_tensors_layers_read_as_another_format_fail(
    ct_checkpoints, tmp_path, scheme, claimed, message
):
    path = with_config(ct_checkpoints(scheme), tmp_path / "ckpt", claimed)
    with pytest.raises(
        CheckpointFormatError, match="layer model.layers.0.self_attn.q_proj"
    ) as info:
        load(path)
    assert message in str(info.value)


@pytest.fixture(scope="module")
def gptq_and_awq(tmp_path_factory):
    root = tmp_path_factory.mktemp("wrong_wna16")
    gptq, _ = build_wna16_checkpoint("gptq", 4, False, root / "gptq")
    awq, _ = build_wna16_checkpoint("awq", 4, False, root / "awq")
    return {"gptq": gptq, "awq": awq}


@pytest.mark.parametrize(
    "source, claimed, message",
    [
        ("gptq", AWQ, "unexpected g_idx"),
        ("awq", GPTQ, "scales has shape (2, 64), expected (16, 8)"),
        ("gptq", W4, "missing weight_packed"),
        ("awq", None, "no quantization_config"),
        ("gptq", {**GPTQ, "bits": 8}, "scales has shape"),
    ],
)
def test_gptq_and_awq_layers_read_as_another_format_fail(
    gptq_and_awq, tmp_path, source, claimed, message
):
    path = with_config(gptq_and_awq[source], tmp_path / "ckpt", claimed)
    with pytest.raises(CheckpointFormatError) as info:
        load(path)
    assert message in str(info.value)


def test_awq_tensors_without_g_idx_read_as_gptq_by_shape_fail(gptq_and_awq, tmp_path):
    """AWQ's qweight [K, N/8] read as GPTQ's [K/8, N]: the scales' shape gives it away."""
    path = with_config(gptq_and_awq["awq"], tmp_path / "ckpt", GPTQ)
    with pytest.raises(CheckpointFormatError, match="not a gptq layer: scales has shape"):
        load(path)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3"])  # qwen3: tie_word_embeddings
def test_a_quantized_lm_head_is_refused(tmp_path, kind):
    path = build_ct_checkpoint("w8a16", tmp_path / "ckpt", ignore=(), config=tiny_config(kind))
    with pytest.raises(UnsupportedQuantization, match="lm_head is quantized .*weight_packed"):
        load(path)


def test_a_tied_checkpoint_with_its_lm_head_in_float_matches_transformers(tmp_path):
    path = build_ct_checkpoint("w4a16", tmp_path / "ckpt", config=tiny_config("qwen3"))
    loaded = load(path)
    assert loaded.config.tie_word_embeddings
    ids = list(range(5, 40))
    with torch.no_grad():
        ref = reference_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, ids, 16), ref, atol=1e-4, rtol=0)


def with_tensors(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint `src` whose state dict `change(state)` edits in place."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    change(state)
    state = {k: v.contiguous() for k, v in state.items()}
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "scheme, change, message",
    [
        ("w4a16", lambda s: s.pop(f"{Q}.weight_scale"), "missing weight_scale"),
        (
            "fp8-dynamic",
            lambda s: s.update({f"{Q}.weight": s[f"{Q}.weight"].to(torch.bfloat16)}),
            "weight is bfloat16, not float8_e4m3fn",
        ),
        (
            "w4a16",
            lambda s: s.update({f"{Q}.weight_packed": s[f"{Q}.weight_packed"][:, :-1]}),
            "weight_packed has shape",
        ),
        (
            "fp8-static",
            lambda s: s.update({f"{Q}.input_scale": torch.ones(64)}),
            "input_scale has shape (64,); a static activation scale is one value",
        ),
        (
            "int8-w8a8",
            lambda s: s.update({f"{Q}.weight_scale": s[f"{Q}.weight_scale"][:32]}),
            "weight_scale has shape (32, 1)",
        ),
    ],
)
def test_tensors_that_contradict_the_config_are_named(
    ct_checkpoints, tmp_path, scheme, change, message
):
    path = with_tensors(ct_checkpoints(scheme), tmp_path / "ckpt", change)
    with pytest.raises(CheckpointFormatError, match=f"layer {Q} is not a {CT} layer") as info:
        load(path)
    assert message in str(info.value)


def test_attention_quantization_left_in_the_checkpoint_is_refused(ct_checkpoints, tmp_path):
    """A query scale (attention quantization a "re:" target reached) is not dropped."""

    def add(state):
        state["model.layers.0.self_attn.q_scale"] = torch.tensor([0.5])

    path = with_tensors(ct_checkpoints("fp8-dynamic"), tmp_path / "ckpt", add)
    with pytest.raises(CheckpointFormatError, match="self_attn.q_scale"):
        load(path)


def test_a_quantized_embedding_is_refused(tmp_path):
    """compressed-tensors quantizes an Embedding a "re:" target reaches; the engine does not."""
    path = build_ct_checkpoint(
        "w8a16", tmp_path / "ckpt", more_groups={"w8a16": [r"re:.*embed_tokens$"]}
    )
    with pytest.raises(UnsupportedQuantization, match="model.embed_tokens is quantized"):
        load(path)

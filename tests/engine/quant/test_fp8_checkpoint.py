"""`quant_method: "fp8"` checkpoints (AutoFP8's and vLLM's layout: `weight` in E4M3,
`weight_scale` a scalar or one per channel, `input_scale` a scalar when static). Their tensors
are compressed-tensors' float-quantized ones under other metadata, so the compressed-tensors
checkpoint (checked against transformers) is rewritten the AutoFP8 way, scalars 0-dim, and
must give the same logits.

Block-wise fp8 (`weight_block_size`, DeepSeek-V3's and Qwen3-*-FP8's layout) is compressed-
tensors' FP8_BLOCK under other names: `weight_scale_inv` for `weight_scale`. transformers
(FineGrainedFP8) reads those files; without a GPU it dequantizes the weights to a float model
and drops the activation quantization, so its weights are compared with ours, and the logits
with the compressed-tensors checkpoint of the same values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.layer_tensors import CheckpointFormatError
from kvbatch.engine.quant.linear import Fp8BlockLinear, Fp8Linear
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_model


def as_fp8_checkpoint(src: Path, dst: Path, activation_scheme: str, kv_scales: bool = False):
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    for name, t in state.items():
        if name.endswith(("weight_scale", "input_scale")) and t.numel() == 1:
            state[name] = t.reshape(())  # AutoFP8 stores per-tensor scales as scalars
    if kv_scales:
        for layer in range(2):
            for kv in ("k_scale", "v_scale"):
                state[f"model.layers.{layer}.self_attn.{kv}"] = torch.tensor(0.05 + layer)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": activation_scheme,
        "ignored_layers": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "scheme, activations", [("fp8-static", "static"), ("fp8-dynamic", "dynamic")]
)
def test_fp8_checkpoint_gives_the_compressed_tensors_logits(
    ct_checkpoints, tmp_path, scheme, activations
):
    src = ct_checkpoints(scheme)
    fp8 = load_model(
        as_fp8_checkpoint(src, tmp_path / "fp8", activations), torch.float32, torch.device("cpu")
    )
    ct = load_model(src, torch.float32, torch.device("cpu"))
    assert fp8.quantization_method == "fp8"
    q_proj = fp8.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Fp8Linear)
    assert (q_proj.input_scale is not None) == (activations == "static")
    ids = list(range(3, 50))
    torch.testing.assert_close(
        prefill_logits(fp8.model, ids, 16), prefill_logits(ct.model, ids, 16), atol=0, rtol=0
    )


def test_kv_cache_scales_are_kept_for_the_kv_cache(ct_checkpoints, tmp_path):
    path = as_fp8_checkpoint(ct_checkpoints("fp8-dynamic"), tmp_path / "fp8", "dynamic", True)
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    assert sorted(loaded.kv_cache_scales) == [
        f"model.layers.{i}.self_attn.{kv}" for i in range(2) for kv in ("k_scale", "v_scale")
    ]
    assert loaded.kv_cache_scales["model.layers.1.self_attn.v_scale"].item() == pytest.approx(1.05)


def as_block_fp8_checkpoint(src: Path, dst: Path, block: list[int], edit=None) -> Path:
    """compressed-tensors' FP8_BLOCK files as DeepSeek and Qwen name them; `edit(state)` may
    change the tensors first."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    state = {(k + "_inv" if k.endswith(".weight_scale") else k): v for k, v in state.items()}
    if edit is not None:
        edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": block,
        "modules_to_not_convert": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("scheme, block", [("fp8-block", [32, 32]), ("fp8-block-n48", [48, 32])])
def test_block_fp8_checkpoint_gives_the_compressed_tensors_logits(
    ct_checkpoints, tmp_path, scheme, block
):
    src = ct_checkpoints(scheme)
    path = as_block_fp8_checkpoint(src, tmp_path / "fp8", block)
    fp8 = load_model(path, torch.float32, torch.device("cpu"))
    ct = load_model(src, torch.float32, torch.device("cpu"))
    assert fp8.quantization_method == "fp8"
    q_proj = fp8.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Fp8BlockLinear) and q_proj.block == tuple(block)
    ids = list(range(3, 50))
    torch.testing.assert_close(
        prefill_logits(fp8.model, ids, 16), prefill_logits(ct.model, ids, 16), atol=0, rtol=0
    )


def test_block_fp8_weights_are_transformers_dequantized_weights(ct_checkpoints, tmp_path):
    """transformers' FineGrainedFP8 reading the same file (weight * weight_scale_inv per
    block) gives our float weights exactly. Only whole blocks here: its dequantizer refuses a
    weight its block grid does not divide (fp8-block-n48's 64 rows in blocks of 48)."""
    path = as_block_fp8_checkpoint(ct_checkpoints("fp8-block"), tmp_path / "fp8", [32, 32])
    ours = load_model(path, torch.float32, torch.device("cpu")).model
    reference = hf_model(path)
    layers = [(n, m) for n, m in ours.named_modules() if isinstance(m, Fp8BlockLinear)]
    assert len(layers) == 14
    for name, layer in layers:
        assert torch.equal(layer.float_weight, reference.get_submodule(name).weight), name


def test_block_fp8_checkpoint_greedy_tokens(ct_checkpoints, tmp_path):
    """Through the engine: the compressed-tensors twin's greedy tokens."""
    src = ct_checkpoints("fp8-block")
    path = as_block_fp8_checkpoint(src, tmp_path / "fp8", [32, 32])
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (5, 19)]
    got = [
        [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for llm in (
            LLM(model=str(path), device="cpu", num_kv_blocks=64),
            LLM(model=str(src), device="cpu", num_kv_blocks=64),
        )
    ]
    assert got[0] == got[1]


def test_block_scales_of_the_wrong_shape_are_refused_naming_the_layer(ct_checkpoints, tmp_path):
    def drop_a_column(state):
        name = "model.layers.1.mlp.down_proj.weight_scale_inv"
        state[name] = state[name][:, :-1].contiguous()

    path = as_block_fp8_checkpoint(
        ct_checkpoints("fp8-block"), tmp_path / "fp8", [32, 32], drop_a_column
    )
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.1\.mlp\.down_proj") as info:
        load_model(path, torch.float32, torch.device("cpu"))
    assert "weight_scale_inv has shape (2, 3)" in str(info.value)
    assert "[2, 4] block scales" in str(info.value)


def test_a_block_size_that_does_not_fit_the_scales_is_refused(ct_checkpoints, tmp_path):
    path = as_block_fp8_checkpoint(ct_checkpoints("fp8-block"), tmp_path / "fp8", [64, 64])
    with pytest.raises(CheckpointFormatError, match="in blocks of \\[64, 64\\]"):
        load_model(path, torch.float32, torch.device("cpu"))

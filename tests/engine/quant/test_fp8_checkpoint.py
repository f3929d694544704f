"""`quant_method: "fp8"` checkpoints (AutoFP8's and vLLM's layout: `weight` in E4M3,
`weight_scale` a scalar or one per channel, `input_scale` a scalar when static). Their tensors
are compressed-tensors' float-quantized ones under other metadata, so the compressed-tensors
checkpoint (checked against transformers) is rewritten the AutoFP8 way, scalars 0-dim, and
must give the same logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.linear import Fp8Linear
from tests.engine.model.test_model import prefill_logits


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

"""compressed-tensors rotations (transform_config), applied and saved by the library: those it
fuses into the weights leave a model that runs as written and gives the unrotated model's
logits; an online one (applied to activations at run time) is refused at load."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.transform import (
    TransformArgs,
    TransformConfig,
    TransformScheme,
    apply_transform_config,
)
from transformers import AutoModelForCausalLM

from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.detect import UnsupportedQuantization
from tests.engine.model.test_model import prefill_logits
from tests.tiny_models import randomize_weights, tiny_config


def rotated_checkpoint(path, schemes: dict[str, TransformScheme]):
    """A tiny Llama rotated by the library, saved with its transform_config; returns the path,
    a prompt, the logits of the model before rotation and its first v_proj weight."""
    config = tiny_config("llama-gqa")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, 0)
    ids = torch.tensor([list(range(3, 40))])
    with torch.no_grad():
        want = model(ids).logits[0]
    v_proj = model.model.layers[0].self_attn.v_proj.weight.detach().clone()
    apply_transform_config(model, TransformConfig(config_groups=schemes))
    model.save_pretrained(path)
    ModelCompressor.from_pretrained_model(model).update_config(str(path))
    return path, ids[0].tolist(), want, v_proj


def per_head(location: str, target: str, inverse: bool = False) -> TransformArgs:
    return TransformArgs(targets=[target], location=location, inverse=inverse)


# SpinQuant's R2: each head's values rotated in v_proj's output, undone in o_proj's input
R2 = TransformScheme(
    type="hadamard",
    head_dim=16,
    apply=[
        per_head("weight_output", r"re:.*v_proj$"),
        per_head("weight_input", r"re:.*o_proj$", inverse=True),
    ],
)
# SpinQuant's R4: down_proj's input rotated at run time, its inverse fused into the weight
R4 = TransformScheme(
    type="hadamard",
    apply=[
        per_head("input", r"re:.*down_proj$"),
        per_head("weight_input", r"re:.*down_proj$", inverse=True),
    ],
)


def test_fused_rotations_give_the_unrotated_models_logits(tmp_path):
    path, ids, want, v_proj = rotated_checkpoint(tmp_path / "r2", {"R2": R2})
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    assert loaded.quantization is None  # nothing left to do at run time
    rotated = loaded.model.model.layers[0].self_attn.v_proj.weight
    assert (rotated - v_proj).abs().max() > 0.1  # the stored weights really are rotated
    torch.testing.assert_close(prefill_logits(loaded.model, ids, 16), want, atol=1e-4, rtol=0)


def test_an_online_rotation_is_refused_at_load(tmp_path):
    """R4's run-time half (down_proj.R4_input.weight) is not run by the engine: without the
    refusal the checkpoint loaded with it dropped, logits off by several units."""
    path, *_ = rotated_checkpoint(tmp_path / "r4", {"R2": R2, "R4": R4})
    with pytest.raises(UnsupportedQuantization, match="'R4' .*online rotation"):
        load_model(path, torch.float32, torch.device("cpu"))

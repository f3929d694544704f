"""Which checkpoints load: unsupported architectures fail with the supported list, and a
supported architecture whose config switches on a feature the engine lacks fails naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvbatch.engine.model.architectures import SUPPORTED_ARCHITECTURES
from kvbatch.engine.model.loader import load_model


def with_config(src, dst, **changes):
    """A copy of checkpoint `src` at `dst` with config.json keys changed (None removes)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load(path):
    return load_model(path, torch.float32, torch.device("cpu"))


def test_the_supported_list_names_every_family():
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in SUPPORTED_ARCHITECTURES
    assert "MixtralForCausalLM" in SUPPORTED_ARCHITECTURES
    for arch in ("Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        assert arch in SUPPORTED_ARCHITECTURES


def test_an_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}'
    )
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM is not supported") as err:
        load(tmp_path)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_model_type_alone_picks_the_architecture(tiny_models, tmp_path):
    """GGUF-derived configs carry only model_type."""
    path = with_config(tiny_models("qwen3-moe"), tmp_path / "m", architectures=None)
    assert load(path).config.architecture == "Qwen3MoeForCausalLM"


@pytest.mark.parametrize(
    "kind, changes, feature",
    [
        ("qwen3", dict(vision_config={"hidden_size": 8}), "a vision or audio tower"),
        ("qwen3-moe", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
        ("mixtral", dict(attention_bias=True), "attention_bias"),
        ("qwen3-moe", dict(use_sliding_window=True, sliding_window=16), "sliding-window"),
        (
            "qwen3",
            dict(layer_types=["full_attention", "sliding_attention"], sliding_window=16),
            "sliding-window",
        ),
    ],
    ids=["vision", "activation", "attention-bias", "moe-sliding", "sliding-layer-types"],
)
def test_an_unsupported_feature_is_named(tiny_models, tmp_path, kind, changes, feature):
    path = with_config(tiny_models(kind), tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=f"checkpoint uses {feature}"):
        load(path)


def test_an_unknown_rope_type_is_named(tiny_models, tmp_path):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    path = with_config(tiny_models("qwen3"), tmp_path / "m", rope_parameters=rope)
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        load(path)

"""Which checkpoints load: unsupported architectures fail with the supported list, and a
supported architecture whose config switches on a feature the engine lacks fails naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvbatch.engine.model.loader import load_model
from kvbatch.engine.model.registry import supported_architectures
from tests.engine.core.test_llm import random_prompts
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_logits

SUPPORTED_ARCHITECTURES = supported_architectures()  # as registered by engine/models/*.py


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
        ("gemma2", dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    ],
    ids=["vision", "activation", "attention-bias", "gemma-activation"],
)
def test_an_unsupported_feature_is_named(tiny_models, tmp_path, kind, changes, feature):
    path = with_config(tiny_models(kind), tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=f"checkpoint uses {feature}"):
        load(path)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-moe", "qwen2", "qwen2-moe"])
def test_qwen_sliding_window_layers_match_transformers(tiny_models, tmp_path, kind):
    """use_sliding_window with max_window_layers: the layers transformers windows (its
    layer_types, or every layer where the config has none) attend within the window."""
    path = with_config(
        tiny_models(kind),
        tmp_path / "m",
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
        layer_types=None,
    )
    model = load(path).model
    ids = random_prompts(512, (60,), seed=3)[0]
    ref = hf_logits(path, ids)
    for chunk in (60, 7, 1):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), ref, atol=1e-4, rtol=0)


def test_an_unknown_rope_type_is_named(tiny_models, tmp_path):
    rope = {"rope_type": "axial", "rope_theta": 10000.0}
    path = with_config(tiny_models("qwen3"), tmp_path / "m", rope_parameters=rope)
    with pytest.raises(ValueError, match="rope type 'axial' is not supported; supported"):
        load(path)

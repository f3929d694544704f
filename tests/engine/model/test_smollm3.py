"""SmolLM3 (engine/models/smollm3.py) against transformers in float32: Llama's layer with NoPE
layers (no_rope_layers[i] == 1 means layer i uses RoPE), here with use_sliding_window giving
the NoPE layers a 24-token window, as transformers' config builds layer_types."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvbatch.engine.model.loader import load_model
from kvbatch.engine.models.smollm3 import SmolLM3ForCausalLM
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts
from tests.engine.model.family_checks import (
    CPU,
    ENGINE_SETTINGS,
    GREEDY,
    assert_logits_match,
    assert_ngram_spec_matches,
    assert_triton_matches,
)
from tests.engine.model.test_model import prefill_logits
from tests.reference import assert_greedy_matches_transformers, hf_logits
from tests.tiny_models import SLIDING_WINDOW


def test_config_reads_the_nope_layers_and_the_window(tiny_models):
    loaded = load_model(tiny_models("smollm3"), torch.float32, CPU)
    cfg = loaded.config
    assert isinstance(loaded.model, SmolLM3ForCausalLM)
    assert cfg.family.uses_rope == (True, False, True, False)
    assert [cfg.is_sliding(i) for i in range(4)] == [False, True, False, True]
    assert cfg.layer_attention(1).sliding_window == SLIDING_WINDOW


def test_logits_match_transformers(tiny_models):
    assert_logits_match(tiny_models("smollm3"))


def edited(src, dst, **change):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text()) | change
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "change",
    [dict(no_rope_layers=[1, 1, 1, 1]), dict(use_sliding_window=False, layer_types=None)],
    ids=["rope-everywhere", "no-window"],
)
def test_each_feature_changes_the_logits(tiny_models, tmp_path, change):
    """The NoPE layers and the window are really applied: the same weights without them give
    other logits, still transformers' for the changed config."""
    src = tiny_models("smollm3")
    other = edited(src, tmp_path / "m", **change)
    ids = random_prompts(512, (60,), seed=4)[0]
    a = prefill_logits(load_model(src, torch.float32, CPU).model, ids, 60)
    b = prefill_logits(load_model(other, torch.float32, CPU).model, ids, 60)
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(b, hf_logits(other, ids), atol=1e-4, rtol=0)


def test_a_published_config_without_a_window_has_none(tiny_models, tmp_path):
    """SmolLM3-3B's config.json names a sliding_window but leaves use_sliding_window off:
    every layer attends to the whole context."""
    other = edited(tiny_models("smollm3"), tmp_path / "m", use_sliding_window=False)
    cfg = load_model(other, torch.float32, CPU).config
    assert cfg.sliding_window is None and not any(cfg.is_sliding(i) for i in range(4))


@pytest.mark.parametrize("settings", ENGINE_SETTINGS.values(), ids=ENGINE_SETTINGS.keys())
def test_greedy_matches_transformers(tiny_models, settings):
    assert_greedy_matches_transformers(
        tiny_models("smollm3"), shared_prefix_prompts(), GREEDY, settings
    )


def test_ngram_speculative_decoding_matches_transformers(tiny_models):
    assert_ngram_spec_matches(tiny_models("smollm3"))


def test_triton_backend_matches_transformers(tiny_models):
    assert_triton_matches(tiny_models("smollm3"))

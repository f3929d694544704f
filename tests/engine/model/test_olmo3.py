"""OLMo 3 (engine/models/olmo3.py) against transformers in float32: post-norm sublayers with no
pre-norms, q/k RMS-normed over the whole projection, three 24-token-window layers and a full
one, each type with its own RoPE (the full layers' YaRN-scaled), q/k/v/o biases."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvbatch.engine import LLM
from kvbatch.engine.kv.hybrid import HybridKVCacheManager
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.models.olmo3 import Olmo3ForCausalLM
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


def test_config_reads_the_layer_types_and_both_ropes(tiny_models):
    loaded = load_model(tiny_models("olmo3"), torch.float32, CPU)
    cfg, model = loaded.config, loaded.model
    assert isinstance(model, Olmo3ForCausalLM) and cfg.qkv_bias and cfg.o_bias
    assert [cfg.is_sliding(i) for i in range(4)] == [True, True, True, False]
    assert cfg.layer_attention(0).sliding_window == SLIDING_WINDOW
    assert cfg.rope.rope_type == "yarn" and cfg.rope.theta == 500000.0
    assert cfg.family.local_rope.rope_type == "default" and cfg.family.local_rope.theta == 1e4
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (4 * 16,)  # every head


def test_logits_match_transformers(tiny_models):
    assert_logits_match(tiny_models("olmo3"))


@pytest.mark.parametrize(
    "change",
    [
        dict(sliding_window=64),
        dict(layer_types=["full_attention"] * 4),
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ],
    ids=["window", "all-full", "one-rope"],
)
def test_each_feature_changes_the_logits(tiny_models, tmp_path, change):
    """The window, the layer types and the per-type RoPE are really applied: the same weights
    with one changed give other logits, still transformers' for the changed config."""
    src = tiny_models("olmo3")
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text()) | change
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    ids = random_prompts(512, (60,), seed=4)[0]
    a = prefill_logits(load_model(src, torch.float32, CPU).model, ids, 60)
    b = prefill_logits(load_model(tmp_path / "m", torch.float32, CPU).model, ids, 60)
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(b, hf_logits(tmp_path / "m", ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("settings", ENGINE_SETTINGS.values(), ids=ENGINE_SETTINGS.keys())
def test_greedy_matches_transformers(tiny_models, settings):
    assert_greedy_matches_transformers(
        tiny_models("olmo3"), shared_prefix_prompts(), GREEDY, settings
    )


def test_local_layers_run_in_window_groups(tiny_models):
    llm = LLM(str(tiny_models("olmo3")), device="cpu", num_kv_blocks=64, max_model_len=256)
    kv = llm.engine.kv
    assert isinstance(kv, HybridKVCacheManager)
    assert [g.window for g in kv.layout.groups] == [None] + [SLIDING_WINDOW] * 3


def test_ngram_speculative_decoding_matches_transformers(tiny_models):
    assert_ngram_spec_matches(tiny_models("olmo3"))


def test_triton_backend_matches_transformers(tiny_models):
    assert_triton_matches(tiny_models("olmo3"))

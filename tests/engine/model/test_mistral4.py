"""Mistral 4 (engine/models/mistral4.py: DeepSeek-V3's MLA layer) against transformers in
float32: softmax routing with shared experts, the rotary part set by partial_rotary_factor,
YaRN with mscale, and queries scaled by position past an original 32 positions (Llama 4's
beta), through prefill, chunked prefill, absorbed decode and prefix caching."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvbatch.engine.model.loader import load_model
from kvbatch.engine.models.deepseek_v3 import MlaForCausalLM
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts
from tests.engine.model.family_checks import (
    CPU,
    GREEDY,
    assert_logits_match,
    assert_ngram_spec_matches,
)
from tests.engine.model.test_deepseek_v3 import MLA_ENGINE_SETTINGS
from tests.engine.model.test_model import prefill_logits
from tests.reference import assert_greedy_matches_transformers, hf_logits


def test_config_reads_routing_rotary_and_query_scale(tiny_models):
    loaded = load_model(tiny_models("mistral4"), torch.float32, CPU)
    cfg, model = loaded.config, loaded.model
    assert isinstance(model, MlaForCausalLM) and cfg.is_latent
    family = cfg.family
    assert family.routing.scoring == "softmax" and not family.routing.correction_bias
    assert family.rope.head_dim == 8  # partial_rotary_factor 8/24 of head_dim 24
    assert family.attention.query_scale_beta == 0.1
    assert family.attention.query_scale_original == 32
    assert not hasattr(model.model.layers[0].mlp.gate, "e_score_correction_bias")
    scale = model.query_scale(torch.tensor([0, 31, 32, 95, 96]), torch.float32)
    want = 1 + 0.1 * torch.log1p(torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0]))
    torch.testing.assert_close(scale, want)


def test_logits_match_transformers(tiny_models):
    assert_logits_match(tiny_models("mistral4"))


def test_query_scaling_changes_the_logits(tiny_models, tmp_path):
    """The position-dependent query scale is applied: without it (beta 0) the logits of a
    prompt past the original length change, and still equal transformers'."""
    src = tiny_models("mistral4")
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    ids = random_prompts(512, (70,), seed=4)[0]
    a = prefill_logits(load_model(src, torch.float32, CPU).model, ids, 70)
    b = prefill_logits(load_model(tmp_path / "m", torch.float32, CPU).model, ids, 70)
    assert (a[40:] - b[40:]).abs().max() > 1e-3
    torch.testing.assert_close(b, hf_logits(tmp_path / "m", ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("settings", MLA_ENGINE_SETTINGS.values(), ids=MLA_ENGINE_SETTINGS.keys())
def test_greedy_matches_transformers(tiny_models, settings):
    assert_greedy_matches_transformers(
        tiny_models("mistral4"), shared_prefix_prompts(), GREEDY, settings
    )


def test_ngram_speculative_decoding_matches_transformers(tiny_models):
    assert_ngram_spec_matches(tiny_models("mistral4"))

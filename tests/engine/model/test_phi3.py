"""Phi-3 / Phi-4 against transformers: fused qkv_proj and gate_up_proj split at load, LongRoPE
with short and long factors and its attention factor, a partial rotary factor (Phi-4-mini's
shape). The tiny checkpoint's pretraining length is 64 tokens: an engine whose max_model_len
fits in it rotates with the short factors, a longer one with the long factors for every
token (transformers does the same for a sequence past 64 tokens)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.model.rope import RopeConfig, rope_config_from_hf
from tests.engine.core.test_llm import random_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import assert_logprobs_match_transformers, hf_greedy, hf_logits
from tests.tiny_models import PHI3_ORIGINAL_CONTEXT

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")


def test_config_reads_longrope_and_partial_rotary(tiny_models):
    cfg = load_model(tiny_models("phi3"), torch.float32, CPU).config
    assert cfg.architecture == "Phi3ForCausalLM"
    assert cfg.rope.rope_type == "longrope" and cfg.rope.head_dim == 12 < cfg.head_dim
    # factor 512 / 64 = 8: sqrt(1 + ln 8 / ln 64) = sqrt(1.5)
    assert cfg.rope.attention_factor == pytest.approx(1.5**0.5)


@pytest.mark.parametrize("length", [53, 100], ids=["short-factors", "long-factors"])
def test_logits_match_transformers(tiny_models, length):
    path = tiny_models("phi3")
    model = load_model(path, torch.float32, CPU).model
    model.rotary.fit_context(length)  # long factors once the context passes 64 tokens
    ids = random_prompts(512, (length,), seed=3)[0]
    ref = hf_logits(path, ids)
    for chunk in (length, 16, 7, 1):
        ours = prefill_logits(model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=f"chunk={chunk}")


@pytest.mark.parametrize(
    "lengths,engine_args",
    [
        ((5, 20, 41), dict(max_model_len=PHI3_ORIGINAL_CONTEXT)),  # short factors
        ((65, 80, 99), dict(max_model_len=256, max_num_batched_tokens=32)),  # long, chunked
    ],
    ids=["short", "long-chunked"],
)
def test_greedy_matches_transformers(tiny_models, lengths, engine_args):
    path = tiny_models("phi3")
    prompts = random_prompts(512, lengths, seed=6)
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=96, **engine_args)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)
    llm.engine.kv.check_integrity()


def test_logprobs_are_transformers(tiny_models):
    assert_logprobs_match_transformers(
        tiny_models("phi3"),
        random_prompts(512, (30,), seed=7)[0],
        num_kv_blocks=16,
        max_model_len=64,
    )


def test_triton_backend_matches_transformers(tiny_models):
    """The Triton rotary kernel rotates only the first 12 dimensions and applies the factor."""
    path = tiny_models("phi3")
    prompts = random_prompts(512, (7, 30), seed=5)
    llm = LLM(
        str(path), device="cpu", dtype="float32", attention_backend="triton", max_model_len=64
    )
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.runner.backend.name == "triton"
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_a_fused_weight_that_does_not_fit_the_config_is_named(tiny_models, tmp_path):
    shutil.copytree(tiny_models("phi3"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # the checkpoint's qkv_proj has 2 kv heads
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj\.weight has 128 rows"):
        load_model(tmp_path / "m", torch.float32, CPU)


def test_longrope_factors_must_cover_the_rotated_dimensions():
    scaling = dict(
        short_factor=[1.0] * 3, long_factor=[2.0] * 4, original_max_position_embeddings=8
    )
    with pytest.raises(ValueError, match="short_factor has 3 values"):
        RopeConfig(head_dim=8, rope_type="longrope", scaling=scaling)
    # Phi-3's first 128k configs name it "su" (transformers 4 form: rope_scaling + rope_theta)
    hf = SimpleNamespace(
        rope_scaling={"type": "su", **scaling, "short_factor": [1.0] * 4},
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    assert rope_config_from_hf(hf, 8).rope_type == "longrope"
    with pytest.raises(ValueError, match="needs 'long_factor'"):
        RopeConfig(head_dim=8, rope_type="longrope", scaling={"short_factor": [1.0] * 4})


def test_phi3_sliding_window_matches_transformers(tiny_models, tmp_path):
    """Phi-3-mini-4k's config has a window (2047) on every layer, as transformers applies it."""
    shutil.copytree(tiny_models("phi3"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["sliding_window"] = 20
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    model = load_model(tmp_path / "m", torch.float32, CPU).model
    assert model.config.layer_attention(1).sliding_window == 20
    ids = random_prompts(512, (50,), seed=8)[0]
    ref = hf_logits(tmp_path / "m", ids)
    for chunk in (50, 7):
        torch.testing.assert_close(prefill_logits(model, ids, chunk), ref, atol=1e-4, rtol=0)

"""Gemma 2 and Gemma 3 (text) against transformers in float32: GeGLU, (1 + w) norms around
both sublayers, embeddings times sqrt(hidden), query_pre_attn_scalar, local (sliding-window)
and global layers, Gemma 2's attention and final soft-caps, Gemma 3's per-head q/k norms and
the local layers' own RoPE base. Prompts are longer than the 24-token window."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.models.gemma import GemmaForCausalLM
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import (
    assert_greedy_matches_transformers,
    assert_logprobs_match_transformers,
    hf_greedy,
    hf_logits,
)
from tests.tiny_models import SLIDING_WINDOW

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")


def test_gemma2_config(tiny_models):
    cfg = load_model(tiny_models("gemma2"), torch.float32, CPU).config
    assert cfg.architecture == "Gemma2ForCausalLM" and cfg.tie_word_embeddings
    local, full = cfg.layer_attention(0), cfg.layer_attention(1)
    assert local.sliding_window == SLIDING_WINDOW and full.sliding_window is None
    assert local.scale == full.scale == pytest.approx(24**-0.5)
    assert local.softcap == 2.0 and cfg.gemma.final_logit_softcap == 8.0


def test_gemma3_config(tiny_models):
    loaded = load_model(tiny_models("gemma3"), torch.float32, CPU)
    cfg, model = loaded.config, loaded.model
    assert isinstance(model, GemmaForCausalLM) and cfg.gemma.qk_norm
    assert [cfg.is_sliding(i) for i in range(3)] == [True, True, False]
    assert cfg.layer_attention(0).softcap is None
    # global layers: base 1e6 and a linear factor of 2; local ones: base 10k
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "linear"
    assert cfg.gemma.local_rope.theta == 10000.0
    assert not torch.equal(model.rotary.inv_freq, model.local_rotary.inv_freq)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_logits_match_transformers(tiny_models, kind):
    path = tiny_models(kind)
    model = load_model(path, torch.float32, CPU).model
    ids = random_prompts(512, (3 * SLIDING_WINDOW + 5,), seed=3)[0]
    ref = hf_logits(path, ids)
    for chunk in (len(ids), 16, 7, 1):
        ours = prefill_logits(model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=f"{kind} chunk={chunk}")


@pytest.mark.parametrize(
    "change",
    [
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(query_pre_attn_scalar=16),
        dict(sliding_window=64),
    ],
    ids=["attention-cap", "final-cap", "query-scale", "window"],
)
def test_each_gemma2_feature_changes_the_logits(tiny_models, tmp_path, change):
    """Each feature is really applied: the same weights with it changed give other logits,
    still equal to transformers' for the changed config."""
    src = tiny_models("gemma2")
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text()) | change
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    ids = random_prompts(512, (40,), seed=4)[0]
    a = prefill_logits(load_model(src, torch.float32, CPU).model, ids, 40)
    b = prefill_logits(load_model(tmp_path / "m", torch.float32, CPU).model, ids, 40)
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(b, hf_logits(tmp_path / "m", ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=True, max_num_batched_tokens=7),  # chunked prefill
        # preemption; a block holds half the layers with window groups: 16 blocks, and 16
        # tokens a step keep a window's blocks few
        dict(num_kv_blocks=16, max_model_len=128, max_num_batched_tokens=16),
        dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=64,
             sliding_window_kv=False),
    ],
    ids=["cache", "chunked", "tiny-pool", "tiny-pool-one-table"],
)  # fmt: skip
def test_greedy_matches_transformers(tiny_models, kind, engine_args):
    path = tiny_models(kind)
    assert_greedy_matches_transformers(path, shared_prefix_prompts(), GREEDY, engine_args)


def test_logprobs_are_transformers(tiny_models):
    assert_logprobs_match_transformers(
        tiny_models("gemma2"), shared_prefix_prompts()[0], num_kv_blocks=64, max_model_len=256
    )


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_triton_backend_matches_transformers(tiny_models, kind):
    path = tiny_models(kind)
    prompts = random_prompts(512, (7, 30), seed=5)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton")
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.runner.backend.name == "triton"
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_an_activation_other_than_tanh_gelu_is_named(tiny_models, tmp_path):
    shutil.copytree(tiny_models("gemma3"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["hidden_activation"] = "relu"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Gemma3ForCausalLM checkpoint uses hidden_activation"):
        load_model(tmp_path / "m", torch.float32, CPU)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_fp8_kv_cache_gives_the_same_tokens_on_both_backends(tiny_models, kind):
    """An FP8 KV cache under windows, soft-caps and Gemma's scale: the triton kernels read the
    same quantized K/V as the torch reference, shared-prefix groups included."""
    path = tiny_models(kind)
    prompts = shared_prefix_prompts()
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(path), device="cpu", dtype="float32", kv_cache_dtype="fp8",
            attention_backend=backend, num_kv_blocks=96, max_model_len=256,
        )  # fmt: skip
        outs[backend] = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert outs["triton"] == outs["torch"]

"""Sizing the KV pool and the context that fits it (kvbatch/engine/kv/sizing.py): a model whose
context is longer than the pool runs by default, capped at what the pool holds; a
max_model_len asked for is still refused when it does not fit."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvbatch.engine import LLM, ContextLengthError, SamplingParams
from kvbatch.engine.kv.sizing import fitted_max_model_len, requests_at_once
from tests.reference import hf_logits
from tests.tiny_models import build_tiny_checkpoint

LONG_CONTEXT = 32768
BLOCK_SIZE = 16
# llama-gqa: 2 layers x (K and V) x 2 KV heads x head_dim 16 x 4 bytes = 512 bytes a token
POOL_TOKENS = 1024
KV_BYTES = POOL_TOKENS * 512
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    """A tiny random Llama whose config says 32k positions, far more than a small pool."""
    path = tmp_path_factory.mktemp("long_context") / "model"
    return build_tiny_checkpoint("llama-gqa", path, max_position_embeddings=LONG_CONTEXT)


def test_the_models_context_is_capped_at_the_pool_and_said_once(long_context_model, caplog):
    with caplog.at_level(logging.INFO, logger="kvbatch.engine"):
        llm = LLM(model=str(long_context_model), device="cpu", kv_cache_bytes=KV_BYTES)
    engine = llm.engine
    assert engine.max_model_len == POOL_TOKENS == engine.kv.num_blocks * BLOCK_SIZE
    assert engine.scheduler.config.max_model_len == POOL_TOKENS
    capped = [r for r in caplog.records if "does not fit the KV cache" in r.getMessage()]
    assert len(capped) == 1
    assert f"max_model_len={POOL_TOKENS}" in capped[0].getMessage()
    startup = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache (")]
    assert len(startup) == 1 and f"max_model_len={POOL_TOKENS}" in startup[0]

    prompt = [3, 17, 41, 99, 5, 8, 250, 11]
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.error is None
    tokens = out.outputs[0].token_ids
    ref = hf_logits(long_context_model, prompt + tokens[:-1]).argmax(-1)
    assert tokens == ref[len(prompt) - 1 :].tolist()


def test_a_request_longer_than_the_capped_context_gets_a_clear_error(long_context_model):
    llm = LLM(model=str(long_context_model), device="cpu", kv_cache_bytes=KV_BYTES)
    prompt = list(range(3, 103))
    too_long = SamplingParams(max_tokens=POOL_TOKENS, temperature=0)
    out = llm.generate([prompt], too_long, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error"
    for words in (
        f"max_model_len={POOL_TOKENS}",
        f"lower max_tokens to {POOL_TOKENS - len(prompt)}",
        f"max_model_len up to {LONG_CONTEXT}",
        "kv_cache_bytes",
    ):
        assert words in out.error
    with pytest.raises(ContextLengthError, match="shorten the prompt"):
        llm.engine.add_request([7] * POOL_TOKENS, GREEDY)
    fits = SamplingParams(max_tokens=POOL_TOKENS - len(prompt), temperature=0, ignore_eos=True)
    llm.engine.add_request(prompt, fits)  # exactly the context: admitted


def test_a_max_model_len_asked_for_must_fit(long_context_model):
    with pytest.raises(ValueError, match=f"one request may need max_model_len={LONG_CONTEXT}"):
        LLM(
            model=str(long_context_model),
            device="cpu",
            kv_cache_bytes=KV_BYTES,
            max_model_len=LONG_CONTEXT,
        )
    llm = LLM(
        model=str(long_context_model), device="cpu", kv_cache_bytes=KV_BYTES, max_model_len=512
    )
    assert llm.engine.max_model_len == 512
    assert llm.engine.context_advice() == ""  # the user's own limit: nothing to advise


def test_fitted_max_model_len():
    assert fitted_max_model_len(64, 16, 512, asked=True) == 512
    assert fitted_max_model_len(64, 16, 4096, asked=False) == 1024
    with pytest.raises(ValueError, match="the draft model's KV too"):
        fitted_max_model_len(64, 16, 4096, asked=True, draft=True)
    with pytest.raises(ValueError, match="holds 0 tokens"):
        fitted_max_model_len(0, 16, 4096, asked=False)


def test_requests_at_once_in_words():
    assert requests_at_once(4096, 512, 64) == (
        "at least 8 run together even if each used the whole max_model_len (512)"
    )
    assert requests_at_once(10_000, 4000, 64).startswith("about 10 requests of 1,000 tokens run")
    assert requests_at_once(1500, 1500, 64).startswith("about 1 request of 1,000 tokens runs")

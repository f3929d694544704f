"""Speculative decoding on the real SmolLM2-135M-Instruct: transformers' greedy tokens, with
n-gram lookup and with draft models, through chunked prefill and the prefix cache."""

from __future__ import annotations

import pytest

from kvbatch.bench.spec_copy import copy_prompts
from kvbatch.engine import LLM, SamplingParams
from tests.engine.spec.test_spec_decode import one_thread  # noqa: F401  (an autouse fixture)
from tests.reference import hf_greedy

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    # A small step budget: prompts are prefilled in chunks, and drafts are trimmed to fit.
    return LLM(
        model=str(smollm2_dir),
        device="cpu",
        kv_cache_bytes=256 << 20,
        max_model_len=2048,
        max_num_batched_tokens=96,
        speculative="ngram",
        num_speculative_tokens=5,
    )


@pytest.fixture(scope="module")
def prompts(llm):
    return copy_prompts(llm.tokenizer, 3)


def test_ngram_greedy_matches_transformers_on_copy_prompts(llm, prompts, smollm2_dir):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(smollm2_dir, prompts, MAX_TOKENS, ignore_eos=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    spec = [o.spec_stats for o in outs]
    assert all(s is not None and s.num_accepted_tokens > 0 for s in spec)
    stats = llm.stats()
    assert stats.spec_acceptance_rate > 0.5  # copying: most drafts are right
    assert stats.generation_tokens > 2 * stats.num_steps  # several tokens per step
    llm.engine.kv.check_integrity()


def test_stop_strings_inside_accepted_runs(llm, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    full = llm.generate(prompts[0], params, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    cut_params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    with_spec = llm.generate(prompts[0], cut_params, use_tqdm=False)[0].outputs[0]
    spec = llm.engine.spec
    llm.engine.spec = None  # the same engine without speculation
    try:
        without = llm.generate(prompts[0], cut_params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.spec = spec
    assert with_spec.text == without.text == text[: text.index(stop)]
    assert with_spec.token_ids == without.token_ids
    assert with_spec.finish_reason == "stop" and with_spec.stop_reason == stop


@pytest.mark.parametrize("draft", ["self", "tiny-random"])
def test_draft_model_greedy_matches_transformers(smollm2_dir, tiny_chat_model, draft, prompts):
    path = smollm2_dir if draft == "self" else tiny_chat_model
    llm = LLM(
        model=str(smollm2_dir),
        device="cpu",
        kv_cache_bytes=256 << 20,  # both pools: the target's and the draft's
        max_model_len=2048,
        max_num_batched_tokens=96,
        speculative=f"draft:{path}",
        num_speculative_tokens=3,
    )
    params = SamplingParams(max_tokens=24, temperature=0)
    out = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(smollm2_dir, prompts[1:2], 24, False)[0]
    s = out.spec_stats
    if draft == "self":
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
    llm.engine.kv.check_integrity()
    llm.engine.spec.proposer.kv.check_integrity()

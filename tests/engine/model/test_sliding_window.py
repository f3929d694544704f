"""Sliding-window attention (Mistral's `sliding_window`, 24 tokens in the tiny checkpoint)
against transformers on prompts longer than the window: logits in prefill chunks, and greedy
tokens through the engine with prefix caching, chunked prefill, preemption and shared-prefix
(cascade) decodes, whose window ends inside the shared prefix."""

from __future__ import annotations

import pytest
import torch

import kvbatch.engine.attention.torch_backend as torch_backend
from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_greedy, hf_logits
from tests.tiny_models import SLIDING_WINDOW

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_every_layer_has_the_window(tiny_models):
    cfg = load_model(tiny_models("mistral-window"), torch.float32, torch.device("cpu")).config
    assert cfg.sliding_window == SLIDING_WINDOW
    assert all(cfg.layer_attention(i).sliding_window == SLIDING_WINDOW for i in range(2))


def test_logits_match_transformers_past_the_window(tiny_models):
    path = tiny_models("mistral-window")
    model = load_model(path, torch.float32, torch.device("cpu")).model
    ids = random_prompts(512, (3 * SLIDING_WINDOW + 5,), seed=3)[0]
    ref = hf_logits(path, ids)
    for chunk in (len(ids), 16, 7, 1):
        ours = prefill_logits(model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=f"chunk={chunk}")


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=True, max_num_batched_tokens=7),  # chunked prefill
        # preemption: a request holds at most its window and a chunk, 4 blocks
        dict(num_kv_blocks=5, max_model_len=128, max_num_batched_tokens=16),
        dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=64,
             sliding_window_kv=False),
        dict(enable_prefix_caching=True, sliding_window_kv=False),  # one table: cascades
    ],
    ids=["cache", "chunked", "tiny-pool", "tiny-pool-one-table", "one-table"],
)  # fmt: skip
def test_greedy_matches_transformers(tiny_models, engine_args, monkeypatch):
    cascades = []
    real = torch_backend.cascade_decode
    monkeypatch.setattr(
        torch_backend, "cascade_decode", lambda *a: cascades.append(len(a[4])) or real(*a)
    )
    path = tiny_models("mistral-window")
    prompts = shared_prefix_prompts()  # 48- and 21-token shared prefixes: past the window
    kw = dict(device="cpu", num_kv_blocks=96, max_model_len=256) | engine_args
    llm = LLM(model=str(path), **kw)
    assert llm.engine.max_model_len > SLIDING_WINDOW  # no longer capped at the window
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)
    stats = llm.stats()
    assert stats.prefix_hits > 0
    assert stats.num_preemptions > 0 or "num_kv_blocks" not in engine_args
    if engine_args.get("sliding_window_kv") is False:  # window groups have no shared prefix
        assert cascades and max(cascades) >= 1  # shared-prefix decodes ran with the window
    llm.engine.kv.check_integrity()


def test_triton_backend_matches_transformers(tiny_models):
    path = tiny_models("mistral-window")
    prompts = random_prompts(512, (7, 40), seed=5)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton")
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.runner.backend.name == "triton"
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_triton_cascade_matches_transformers(tiny_models):
    """Shared-prefix groups on the triton backend: the non-causal shared part places each
    row's query after the prefix (row_offsets), so windows that end inside it are right."""
    path = tiny_models("mistral-window")
    prompts = shared_prefix_prompts()
    llm = LLM(
        str(path), device="cpu", dtype="float32", attention_backend="triton",
        sliding_window_kv=False,  # window groups hold no prefix every row reads
    )  # fmt: skip
    backend = llm.engine.runner.backend
    merges = []
    real_merge = backend._merge
    backend._merge = lambda *a, **kw: merges.append(1) or real_merge(*a, **kw)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert merges  # decodes ran as shared-prefix groups
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)

"""Window KV groups (engine/kv/layout.py, hybrid.py) through the engine on the tiny Gemma 3
(local, local, global; window 24) and Gemma 2: the same greedy tokens as transformers with
windows crossing blocks, chunked prefill, preemption, prefix hits and speculative rollbacks;
fewer blocks held, so more sequences at once in the same KV bytes."""

from __future__ import annotations

import logging
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.kv.hybrid import HybridKVCacheManager
from kvbatch.jobs.grouping import group_by_prefix
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.engine.exec.padded_graphs import padded_graph_tokens
from tests.reference import hf_greedy
from tests.tiny_models import SLIDING_WINDOW

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def peak_running(llm: LLM, prompts, params) -> tuple[list, int]:
    """The outputs and the most sequences the scheduler held at once."""
    engine, peak = llm.engine, [0]
    real_step = engine.step

    def step():
        out = real_step()
        peak[0] = max(peak[0], len(engine.scheduler.running))
        return out

    engine.step = step
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, peak[0]


def whole_requests_at_once(records) -> float:
    """'at least N run together even if each used the whole max_model_len' of the startup line."""
    (line,) = [r.getMessage() for r in records if r.getMessage().startswith("KV cache (")]
    return float(re.search(r"at least ([0-9.]+)", line).group(1))


def test_the_startup_lines_count_each_group(tiny_models, caplog):
    caplog.set_level(logging.INFO, logger="kvbatch.engine.kv.sizing")
    kw = dict(device="cpu", kv_cache_bytes=1 << 20, max_model_len=512, max_num_batched_tokens=32)
    LLM(str(tiny_models("gemma3")), sliding_window_kv=False, **kw)
    one_table = whole_requests_at_once(caplog.records)
    caplog.clear()
    LLM(str(tiny_models("gemma3")), **kw)
    # a request of 512 tokens holds 32 blocks of one layer's KV in group 0 and 5 in each
    # window group (its window and a 32-token chunk), where one table held 32 of three layers'
    assert whole_requests_at_once(caplog.records) > 2 * one_table
    caplog.clear()
    llm = LLM(str(tiny_models("gemma3")), device="cpu", num_kv_blocks=64, max_model_len=256)
    assert isinstance(llm.engine.kv, HybridKVCacheManager)
    lines = [r.getMessage() for r in caplog.records if "KV group" in r.getMessage()]
    assert len(lines) == 3
    assert lines[0].startswith("KV group 0 (full attention, layers 2): keeps every block")
    assert lines[1].startswith(f"KV group 1 (window {SLIDING_WINDOW}, layers 0): frees blocks")
    assert "16 blocks per request of max_model_len=256" in lines[0]
    # one slot: a block holds one layer of each group, so 64 blocks cost a third of before
    assert sum(t.numel() for t in set(llm.engine.runner.kv_caches)) * 3 == sum(
        t.numel() for t in LLM(
            str(tiny_models("gemma3")), device="cpu", num_kv_blocks=64, max_model_len=256,
            sliding_window_kv=False,
        ).engine.runner.kv_caches
    )  # fmt: skip


def test_more_sequences_fit_in_the_same_bytes(tiny_models):
    """Eight 160-token prompts in a KV cache that holds four of them whole: with window
    groups the local layers keep a window each, and more run at once; tokens unchanged."""
    path = tiny_models("gemma3")
    prompts = random_prompts(512, (160,) * 8, seed=11)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    per_token = 2 * 2 * 16 * 4  # K and V, 2 kv heads of 16, float32: one layer
    kw = dict(device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=128)
    kw["kv_cache_bytes"] = 4 * 176 * 3 * per_token
    on_outs, on = peak_running(LLM(str(path), **kw), prompts, params)
    off_outs, off = peak_running(LLM(str(path), sliding_window_kv=False, **kw), prompts, params)
    assert off <= 4
    assert on >= 2 * off
    assert tokens(on_outs) == tokens(off_outs) == hf_greedy(path, prompts, 16, ignore_eos=True)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=4, max_num_batched_tokens=5),  # the window spans 6 blocks
        dict(block_size=8, num_kv_blocks=28, max_model_len=128, max_num_batched_tokens=8),
        dict(block_size=4, speculative="ngram", num_speculative_tokens=3),
    ],
    ids=["chunked", "preempted", "speculative"],
)
def test_greedy_matches_transformers_across_blocks(tiny_models, kind, engine_args):
    path = tiny_models(kind)
    prompts = shared_prefix_prompts() + random_prompts(512, (70, 3 * SLIDING_WINDOW), seed=4)
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=256)
    llm = LLM(str(path), **(kw | engine_args))
    assert isinstance(llm.engine.kv, HybridKVCacheManager)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)
    stats = llm.stats()
    assert stats.prefix_hits > 0
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_prefix_hits_equal_one_tables(tiny_models):
    """With room to spare, window groups keep every prefix hit one table would have."""
    path = tiny_models("gemma3")
    prompts = shared_prefix_prompts()
    kw = dict(device="cpu", num_kv_blocks=256, max_model_len=256)
    on = LLM(str(path), **kw)
    off = LLM(str(path), sliding_window_kv=False, **kw)
    assert tokens(on.generate(prompts, GREEDY, use_tqdm=False)) == tokens(
        off.generate(prompts, GREEDY, use_tqdm=False)
    )
    assert on.stats().prefix_hits == off.stats().prefix_hits > 0


def test_triton_backend_matches_transformers(tiny_models):
    path = tiny_models("gemma3")
    prompts = random_prompts(512, (30, 61), seed=6)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton", block_size=8)
    assert isinstance(llm.engine.kv, HybridKVCacheManager)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_n_choices_share_the_prompt_across_groups(tiny_models):
    """n = 2: the second choice forks the first's blocks in every group (its window's still
    held), and both give transformers' greedy tokens."""
    path = tiny_models("gemma3")
    prompts = random_prompts(512, (3 * SLIDING_WINDOW + 5, 40), seed=8)
    params = SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=128, block_size=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    want = hf_greedy(path, prompts, 8, ignore_eos=True)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w, w] for w in want]
    # each prompt once; a child recomputes only the prompt's partly filled last block
    assert llm.stats().computed_tokens <= sum(map(len, prompts)) + 2 * 8 + 2 * 2 * 8


def test_a_window_only_model_runs_past_a_pool_one_table_could_not_hold(tiny_models):
    """Mistral's window on every layer: a request holds its window and a chunk, so 240-token
    contexts run in a pool of 8 blocks of 16 tokens (128), where one table refuses them."""
    path = tiny_models("mistral-window")
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=256)
    kw["max_num_batched_tokens"] = 16
    with pytest.raises(ValueError, match="max_model_len=256"):
        LLM(str(path), sliding_window_kv=False, **kw)
    llm = LLM(str(path), **kw)
    prompts = random_prompts(512, (230, 120), seed=9)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32))
def test_prefill_stays_at_the_ideal(tiny_models, seed):
    """A two-level job (system prompt, documents, chunks; shuffled) in its prefix order, on
    a pool of the same bytes as one table that holds the system prompt, the largest document
    group and two running sequences: window groups serve every prefix hit one table would,
    the ideal of the order (tests/jobs/test_prefill_ideal.py asserts it for one table)."""
    rng, bs = random.Random(seed), 16
    vocab = range(3, 512)
    system = rng.choices(vocab, k=rng.randint(1, 48))
    groups = []
    for _ in range(rng.randint(1, 5)):
        doc = rng.choices(vocab, k=rng.randint(16, 96))
        groups.append([system + doc + rng.choices(vocab, k=rng.randint(1, 32))
                       for _ in range(rng.randint(1, 4))])  # fmt: skip
    prompts = [p for g in groups for p in g]
    rng.shuffle(prompts)
    order = group_by_prefix(prompts, bs)
    longest = max(map(len, prompts)) + 4
    group_blocks = max(-(-sum(len(p) for p in g) // bs) + len(g) for g in groups)
    fit = -(-len(system) // bs) + group_blocks + 2 * (-(-longest // bs) + 2)
    llm = LLM(
        str(tiny_models("gemma3")), device="cpu", max_model_len=longest, max_num_seqs=2,
        block_size=bs, num_kv_blocks=3 * fit,  # a block holds one of the 3 layers
    )  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[i] for i in order.order], params, use_tqdm=False)
    assert llm.stats().prefix_hits == order.ideal_cached_tokens
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_a_window_as_long_as_the_context_keeps_one_table(tiny_models):
    """Requests no longer than the window never free a block: one table, no group cost."""
    path = str(tiny_models("gemma3"))
    short = LLM(path, device="cpu", num_kv_blocks=64, max_model_len=SLIDING_WINDOW)
    assert not isinstance(short.engine.kv, HybridKVCacheManager)
    long = LLM(path, device="cpu", num_kv_blocks=64, max_model_len=SLIDING_WINDOW + 1)
    assert isinstance(long.engine.kv, HybridKVCacheManager)


def test_the_graph_buffers_of_each_group_give_transformers_tokens(tiny_models, monkeypatch):
    """The CUDA-graph static-buffer path (run eagerly on the CPU): each group's tables in its
    own buffers, blocks of 4 tokens leaving the window between replays."""
    path = tiny_models("gemma3")
    prompts = random_prompts(512, (41, 30, 9), seed=12)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = hf_greedy(path, prompts, params.max_tokens, ignore_eos=True)
    assert padded_graph_tokens(path, prompts, params, monkeypatch, block_size=4) == want

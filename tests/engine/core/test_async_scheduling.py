"""Async scheduling: each step is queued before the previous step's tokens reach the host.

On the CPU the forward runs before `launch` returns, so nothing overlaps here, but the
bookkeeping is exactly the GPU's: pending tokens read on the device, stops found a step late,
preemption and aborts while a token is in flight. Every test compares with steps in turn.
"""

from __future__ import annotations

import random

import pytest

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.core.sequence import SequenceStatus
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def run(path, prompts, params, *, async_scheduling: bool, **engine_args):
    args = dict(device="cpu", num_kv_blocks=64, max_model_len=256) | engine_args
    llm = LLM(model=str(path), async_scheduling=async_scheduling, **args)
    assert llm.engine.async_scheduling is async_scheduling
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.kv.check_integrity()
    assert not llm.engine.has_unfinished()
    return outs, llm.engine


def finish_reasons(outs):
    return [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),
        dict(max_num_batched_tokens=7),  # chunked prefill across many steps
        dict(max_num_seqs=3),  # requests admitted as others finish
        # preemption, once of a sequence whose token is in flight
        dict(num_kv_blocks=7, max_model_len=96, max_num_batched_tokens=64),
    ],
    ids=["plain", "tiny-budget", "three-seqs", "tiny-pool"],
)
def test_same_tokens_as_steps_in_turn(tiny_models, engine_args):
    path = tiny_models("llama-gqa")
    prompts = shared_prefix_prompts()
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        for n in (1, 12, 3, 7, 12, 2, 9, 5)
    ]
    want, sync = run(path, prompts, params, async_scheduling=False, **engine_args)
    got, engine = run(path, prompts, params, async_scheduling=True, **engine_args)
    assert tokens(got) == tokens(want)
    assert [len(t) for t in tokens(got)] == [p.max_tokens for p in params]
    # max_tokens is known before the last token arrives: no step computes a row past it, and
    # the request's place and blocks go to others as soon as its last step is queued
    assert engine.stats().num_steps == sync.stats().num_steps
    assert engine.stats().computed_tokens == sync.stats().computed_tokens
    if "num_kv_blocks" in engine_args:
        assert engine.stats().num_preemptions > 0


def test_stop_tokens_found_a_step_late_cost_one_dropped_row(tiny_models):
    path = tiny_models("llama-gqa")
    prompts = random_prompts(512, (5, 16, 17, 33, 40, 9))
    free, _ = run(path, prompts, GREEDY, async_scheduling=False)
    # stop each request on its 4th token (a token it would generate anyway)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[t[3]]) for t in tokens(free)
    ]
    want, sync = run(path, prompts, params, async_scheduling=False)
    got, engine = run(path, prompts, params, async_scheduling=True)
    assert tokens(got) == tokens(want)
    assert finish_reasons(got) == finish_reasons(want)
    assert all(reason == "stop" for reason, _ in finish_reasons(got))
    # the step after a stop already ran the stopped request's next decode: dropped
    assert engine.stats().computed_tokens > sync.stats().computed_tokens
    assert engine.stats().generation_tokens == sync.stats().generation_tokens


def test_stop_strings(tiny_chat_model):
    prompts = ["Hello there", "Write a list", "One two three four"]
    free, _ = run(tiny_chat_model, prompts, GREEDY, async_scheduling=False)
    stops = [o.outputs[0].text[3:6] for o in free]  # text each request will produce
    assert all(stops)
    params = [SamplingParams(max_tokens=12, temperature=0.0, stop=[s]) for s in stops]
    want, _ = run(tiny_chat_model, prompts, params, async_scheduling=False)
    got, _ = run(tiny_chat_model, prompts, params, async_scheduling=True)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert tokens(got) == tokens(want)
    assert finish_reasons(got) == finish_reasons(want)


def test_seeded_sampling_and_logprobs(tiny_models):
    """A seeded row's noise depends on the index of the token it samples: with a token still
    pending, that index counts it."""
    path = tiny_models("llama-gqa")
    prompts = random_prompts(512, (5, 16, 17, 33))
    params = [
        SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=s, logprobs=3)
        for s in range(len(prompts))
    ]
    want, _ = run(path, prompts, params, async_scheduling=False)
    got, _ = run(path, prompts, params, async_scheduling=True)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_the_context_limit_is_known_in_advance(tiny_models):
    path = tiny_models("llama-gqa")
    prompts = random_prompts(512, (60, 30))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    want, sync = run(path, prompts, params, async_scheduling=False, max_model_len=64)
    got, engine = run(path, prompts, params, async_scheduling=True, max_model_len=64)
    assert tokens(got) == tokens(want)
    assert [len(t) for t in tokens(got)] == [4, 34]
    assert engine.stats().computed_tokens == sync.stats().computed_tokens


def test_steps_overlap_the_previous_steps_tokens(tiny_models):
    """The second step is scheduled while the first step's tokens are pending; the last
    call runs no model and only finishes the requests."""
    llm = LLM(model=str(tiny_models("llama-gqa")), device="cpu", async_scheduling=True)
    engine = llm.engine
    prompt = random_prompts(512, (20,))[0]
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seq = engine.requests["0"]
    assert engine.step() == []  # the prompt ran; its first token is on its way
    assert (len(seq.token_ids), seq.num_pending, seq.num_tokens) == (20, 1, 21)
    assert engine.step() == []  # the second token's step queued, then the first token landed
    assert (len(seq.token_ids), seq.num_pending) == (21, 1)
    assert engine.step() == []
    assert (len(seq.token_ids), seq.num_pending, engine.stats().num_steps) == (22, 1, 3)
    (out,) = engine.step()  # nothing left to run: the last token lands
    assert engine.stats().num_steps == 3
    assert len(out.outputs[0].token_ids) == 3 and not engine.has_unfinished()


def test_abort_while_a_token_is_in_flight(tiny_models):
    path = tiny_models("llama-gqa")
    prompts = random_prompts(512, (5, 16, 17))
    want, _ = run(path, prompts, GREEDY, async_scheduling=False)
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):
        engine.step()
    victim = engine.requests[ids[1]]
    assert victim.num_pending == 1
    engine.abort_request(ids[1])
    assert victim.status is SequenceStatus.FINISHED
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert sorted(outs) == [ids[0], ids[2]]
    assert outs[ids[0]].outputs[0].token_ids == tokens(want)[0]
    assert outs[ids[2]].outputs[0].token_ids == tokens(want)[2]
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_speculative_decoding_keeps_steps_in_turn(tiny_models):
    path = str(tiny_models("llama-gqa"))
    assert LLM(model=path, device="cpu", speculative="ngram").engine.async_scheduling is False
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(model=path, device="cpu", speculative="ngram", async_scheduling=True)


def test_off_by_default_on_the_cpu(tiny_models):
    assert LLM(model=str(tiny_models("llama-gqa")), device="cpu").engine.async_scheduling is False


@pytest.mark.parametrize("seed", [1, 4, 5])  # seeds whose runs preempt
def test_random_jobs_match_steps_in_turn(tiny_models, seed):
    """Random prompts sharing prefixes, random lengths and stop tokens, a small pool (so
    requests are preempted, some with a token in flight) and a small step budget."""
    rng = random.Random(seed)
    path = tiny_models("llama-gqa")
    docs = random_prompts(512, (16, 40, 7), seed=seed)
    tails = random_prompts(512, [rng.randint(1, 30) for _ in range(14)], seed=seed + 10)
    prompts = [rng.choice(docs + [[]]) + t for t in tails]
    engine_args = dict(
        num_kv_blocks=rng.randint(7, 12),
        max_model_len=96,
        max_num_seqs=rng.randint(2, 8),
        max_num_batched_tokens=rng.randint(16, 64),
    )
    lengths = [rng.randint(1, 15) for _ in prompts]
    free, _ = run(
        path,
        prompts,
        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths],
        async_scheduling=False,
        **engine_args,
    )
    params = [
        SamplingParams(
            max_tokens=n,
            temperature=0.0,
            ignore_eos=True,
            # half stop on a token they would produce
            stop_token_ids=[rng.choice(t)] if t and rng.random() < 0.5 else None,
        )
        for n, t in zip(lengths, tokens(free))
    ]
    want, sync = run(path, prompts, params, async_scheduling=False, **engine_args)
    got, engine = run(path, prompts, params, async_scheduling=True, **engine_args)
    assert tokens(got) == tokens(want)
    assert finish_reasons(got) == finish_reasons(want)
    assert engine.stats().generation_tokens == sync.stats().generation_tokens
    assert engine.stats().num_preemptions > 0 and sync.stats().num_preemptions > 0
    assert any(reason == "stop" for reason, _ in finish_reasons(got))


def test_output_blocks_reach_the_prefix_cache_as_in_turn(tiny_models):
    """A request's last computed block holds a token that was still pending when its slot was
    given: it is registered when the request ends (as steps in turn register it), so a later
    prompt that repeats the conversation finds every computed block."""
    path = tiny_models("llama-gqa")
    prompt = random_prompts(512, (20,), seed=7)[0]
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)  # 32 computed
    cached = []
    for async_scheduling in (False, True):
        llm = LLM(
            model=str(path), device="cpu", num_kv_blocks=64, async_scheduling=async_scheduling
        )
        (first,) = llm.generate([prompt], params, use_tqdm=False)
        follow_up = prompt + first.outputs[0].token_ids + [5, 6, 7]
        (second,) = llm.generate([follow_up], GREEDY, use_tqdm=False)
        cached.append(second.num_cached_tokens)
        llm.engine.kv.check_integrity()
    assert cached == [32, 32]

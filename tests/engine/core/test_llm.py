"""The engine end to end on tiny random checkpoints, against transformers' greedy tokens."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from tests.reference import hf_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def shared_prefix_prompts(vocab: int = 512) -> list[list[int]]:
    """Groups sharing 3-block and 1-block prefixes, plus loners, of uneven lengths."""
    doc_a, doc_b = random_prompts(vocab, (48, 21), seed=1)
    tails = random_prompts(vocab, (3, 9, 17, 30, 1, 12, 5, 40), seed=2)
    return [doc_a + t for t in tails[:4]] + [doc_b + t for t in tails[4:6]] + [tails[6], tails[7]]


@pytest.fixture(scope="module")
def reference(tiny_models):
    """transformers' greedy tokens for the shared-prefix prompts on llama-gqa."""
    prompts = shared_prefix_prompts()
    return prompts, hf_greedy(tiny_models("llama-gqa"), prompts, 12, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha", "llama3-rope", "qwen2", "mistral"])
def test_greedy_matches_transformers(tiny_models, kind):
    path = tiny_models(kind)
    prompts = random_prompts(512, (1, 5, 16, 17, 33, 64))
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64, max_model_len=256)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == hf_greedy(path, prompts, 12, ignore_eos=True)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    llm.engine.kv.check_integrity()


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=False),
        dict(enable_prefix_caching=True),
        dict(max_num_batched_tokens=7),  # chunked prefill across many steps
        dict(max_num_seqs=2),
        dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=64),  # preemption
    ],
    ids=["no-cache", "cache", "tiny-budget", "two-seqs", "tiny-pool"],
)
def test_same_tokens_whatever_the_engine_settings(tiny_models, reference, engine_args):
    prompts, expected = reference
    kw = dict(device="cpu", num_kv_blocks=96, max_model_len=256) | engine_args
    llm = LLM(model=str(tiny_models("llama-gqa")), **kw)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == expected
    if "num_kv_blocks" in engine_args:
        assert llm.stats().num_preemptions > 0
    llm.engine.kv.check_integrity()


def test_same_tokens_whatever_the_batch_order(tiny_models, reference):
    prompts, expected = reference
    order = list(range(len(prompts)))
    random.Random(5).shuffle(order)
    llm = LLM(
        model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=96, max_model_len=256
    )
    outs = llm.generate([prompts[i] for i in order], GREEDY, use_tqdm=False)
    assert tokens(outs) == [expected[i] for i in order]


def test_three_shared_blocks_report_48_cached_tokens(tiny_models):
    doc, a, b = random_prompts(512, (48, 5, 7), seed=9)
    llm = LLM(
        model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=32, max_model_len=128
    )
    first = llm.generate([doc + a], GREEDY, use_tqdm=False)[0]
    second = llm.generate([doc + b], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48
    stats = llm.stats()
    assert stats.prefix_hits == 48 and stats.prefix_queries == 48 * 2 + 12
    # Prefix caching off: nothing is reused.
    off = LLM(
        model=str(tiny_models("llama-gqa")),
        device="cpu",
        num_kv_blocks=32,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    off.generate([doc + a], GREEDY, use_tqdm=False)
    assert off.generate([doc + b], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_streaming_form(tiny_models):
    llm = LLM(
        model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=32, max_model_len=128
    )
    engine = llm.engine
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for p, n in zip(random_prompts(512, (4, 9)), (3, 6))
    ]
    finished = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] = out
        steps += 1
    assert set(finished) == set(ids) and steps == 6
    assert [len(finished[i].outputs[0].token_ids) for i in ids] == [3, 6]
    assert llm.stats().num_finished == 2 and llm.stats().generation_tokens == 9


def test_eos_stops_unless_ignored(tiny_models, reference):
    prompts, expected = reference
    seq = expected[0]
    k = next(i for i in range(2, len(seq)) if seq[i] not in seq[:i])
    eos = seq[k]  # pretend this greedy token (its first appearance) is the end of sequence
    llm = LLM(
        model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=64, max_model_len=256
    )
    llm.engine.stop_checker.eos = frozenset({eos})
    stopped = llm.generate(
        prompts[0], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False
    )[0]
    assert stopped.outputs[0].token_ids == seq[: k + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    kept = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0]
    assert kept.outputs[0].token_ids == expected[0]
    by_id = llm.generate(
        prompts[0],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[eos]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == seq[: k + 1] and by_id.stop_reason == eos


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_models):
    llm = LLM(
        model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=64, max_model_len=256
    )
    prompts = random_prompts(512, (7, 20, 13))
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=10, temperature=0.8, ignore_eos=True)
    alone = llm.generate(prompts[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(prompts, [other, seeded, other], use_tqdm=False)[1]
    assert batched.outputs[0].token_ids == alone
    different = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert llm.generate(prompts[1], different, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_logprobs_are_the_models_distribution(tiny_models, reference):
    from tests.reference import hf_logits

    prompts, expected = reference
    path = tiny_models("llama-gqa")
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64, max_model_len=256)
    out = llm.generate(
        prompts[0],
        SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    lps = out.outputs[0].logprobs
    assert [lp.token_id for lp in lps] == expected[0][:3]
    ref = torch.log_softmax(hf_logits(path, prompts[0] + expected[0][:2]), -1)
    for i, lp in enumerate(lps):
        row = ref[len(prompts[0]) - 1 + i]
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        top = torch.topk(row, 2)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_a_bad_prompt_fails_alone(tiny_models):
    llm = LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=32, max_model_len=64)
    good = random_prompts(512, (5,))[0]
    outs = llm.generate([good, list(range(3, 67)), [], [5, 600], "text"], GREEDY, use_tqdm=False)
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 12
    assert "max_model_len=64" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert "empty" in outs[2].error
    assert "600" in outs[3].error
    assert "no tokenizer" in outs[4].error


def test_token_ids_are_checked_and_the_offender_named(tiny_models):
    """Plain ints take add_request's fast check; anything else its generator, which names the
    first bad id (the vocabulary is 512)."""
    engine = LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=32).engine
    for bad in (-1, 512, True, 2.0, np.int64(7), "7", None):
        with pytest.raises(ValueError, match=re.escape(f"token id {bad!r} is not an int in")):
            engine.add_request([5, 6, bad, 8])

    class TokenId(int):  # int subclasses (an IntEnum, say) pass as ints
        pass

    rid = engine.add_request((5, TokenId(511), 0))
    assert engine.requests[rid].prompt_token_ids == [5, 511, 0]
    rid = engine.add_request({"prompt_token_ids": (3, 4)})
    assert engine.requests[rid].prompt_token_ids == [3, 4]


def test_generation_stops_at_the_context_limit(tiny_models):
    llm = LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=8, max_model_len=32)
    out = llm.generate(random_prompts(512, (28,))[0], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_a_pool_too_small_fails_at_construction(tiny_models):
    with pytest.raises(ValueError, match="raise kv_cache_bytes.*or lower max_model_len"):
        LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLM(model=str(tiny_models("llama-gqa")), device="cpu", max_model_len=10**6)


def test_invalid_engine_settings_name_the_field(tiny_models):
    for kw, field in [
        (dict(block_size=12), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(dtype="int3"), "dtype"),
        (dict(attention_backend="x"), "attention_backend"),
        (dict(cuda_graph_max_chunk=-1), "cuda_graph_max_chunk"),
    ]:
        with pytest.raises(ValueError, match=field):
            LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=64, **kw)


def test_queue_time_ends_when_the_scheduler_first_admits_a_request(tiny_models):
    """With one sequence at a time, the second request waits in the queue until the first has
    produced its last token: its queue time covers that wait, the first's is near zero."""
    llm = LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=32,
              max_model_len=128, max_num_seqs=1)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first, second = llm.generate([[5, 6, 7], [8, 9, 10]], params, use_tqdm=False)
    m1, m2 = first.metrics, second.metrics
    assert 0 <= m1.queue_time <= m1.time_to_first_token
    assert m2.queue_time >= m1.finished_time - m2.arrival_time > 0
    assert m2.queue_time <= m2.time_to_first_token

"""n > 1: children fork the prompt's KV blocks, each choice its own seed stream."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.core.choices import choice_params
from kvbatch.engine.kv.kv_cache import KVCacheManager

# ---------------------------------------------------------------- KVCacheManager.fork


def test_fork_shares_full_blocks_and_keeps_the_partial_one_private() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=16)
    prompt = list(range(100, 137))  # 37 tokens: 2 full blocks and 5 tokens
    assert kv.allocate_slots("p", prompt, 37)
    parent = kv.block_table("p")
    assert kv.fork("p", "c", 36) == 32
    assert kv.block_table("c") == parent[:2]
    assert kv.num_computed_tokens("c") == 32
    kv.check_integrity()  # ref counts 2 on the shared blocks, 1 on the parent's last
    assert kv.allocate_slots("c", prompt, 5)  # the child computes the last 5 itself
    child = kv.block_table("c")
    assert child[:2] == parent[:2] and child[2] != parent[2]
    kv.check_integrity()
    kv.free("p", prompt)
    kv.check_integrity()
    assert kv.num_free_blocks == 12 - 3  # the child still holds the shared two
    kv.free("c", prompt)
    kv.check_integrity()
    assert kv.num_free_blocks == 12


def test_fork_of_a_short_or_unknown_parent_shares_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=16)
    assert kv.fork("nobody", "c", 40) == 0
    assert kv.allocate_slots("p", list(range(10)), 10)
    assert kv.fork("p", "c", 9) == 0  # no full block
    assert kv.block_table("c") == []
    with pytest.raises(ValueError, match="already has blocks"):
        kv.fork("p", "p", 9)
    kv.check_integrity()


@pytest.mark.parametrize("prompt_len", [33, 48, 64])
def test_forked_child_continues_the_hash_chain(prompt_len: int) -> None:
    """A block the child fills after the shared ones is cached under the right prefix: a
    later sequence with the child's tokens hits it."""
    kv = KVCacheManager(num_blocks=20, block_size=16)
    prompt = list(range(prompt_len))
    assert kv.allocate_slots("p", prompt, prompt_len)
    kv.allocate_slots("p", prompt + [7], 1)  # the parent's first output token
    shared = kv.fork("p", "c", prompt_len - 1)
    assert shared == (prompt_len - 1) // 16 * 16
    child_tokens = prompt + [999] * 40
    assert kv.allocate_slots("c", child_tokens, len(child_tokens) - shared)
    kv.check_integrity()
    full = len(child_tokens) // 16
    hit = kv.get_computed_blocks(child_tokens + [1])
    assert len(hit.block_ids) == full
    # where the child recomputed a whole prompt block, the hit takes the parent's cached twin;
    # the blocks of the child's own tokens after the prompt are its own
    own = prompt_len // 16
    assert hit.block_ids[own:] == kv.block_table("c")[own:full]
    kv.free("c", child_tokens)
    kv.free("p")
    kv.check_integrity()


def test_random_forks_keep_the_invariants() -> None:
    g = torch.Generator().manual_seed(0)
    kv = KVCacheManager(num_blocks=64, block_size=4)
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(400):
        op = int(torch.randint(0, 3, (1,), generator=g))
        if op == 0 or not live:
            n = int(torch.randint(1, 30, (1,), generator=g))
            tokens = torch.randint(0, 5, (n,), generator=g).tolist()
            if kv.allocate_slots(next_id, tokens, n, kv.get_computed_blocks(tokens)):
                live[next_id] = tokens
                next_id += 1
        elif op == 1:
            parent = list(live)[int(torch.randint(0, len(live), (1,), generator=g))]
            tokens = live[parent]
            shared = kv.fork(parent, next_id, len(tokens) - 1)
            more = tokens + torch.randint(0, 5, (6,), generator=g).tolist()
            if kv.allocate_slots(next_id, more, len(more) - shared):
                live[next_id] = more
            else:
                kv.free(next_id)
            next_id += 1
        else:
            victim = list(live)[int(torch.randint(0, len(live), (1,), generator=g))]
            kv.free(victim, live.pop(victim))
        kv.check_integrity()
    for seq_id, tokens in live.items():
        kv.free(seq_id, tokens)
    kv.check_integrity()
    assert kv.num_free_blocks == 64


# ---------------------------------------------------------------- choice params


def test_choice_params_give_each_choice_its_seed() -> None:
    p = SamplingParams(n=4, seed=2**63 - 2, temperature=0.7)
    seeds = [choice_params(p, i).seed for i in range(4)]
    assert seeds == [2**63 - 2, 2**63 - 1, 0, 1]  # wraps inside the int64 range
    assert all(choice_params(p, i).n == 1 for i in range(4))
    assert choice_params(SamplingParams(n=2), 1).seed is None


@pytest.mark.parametrize("bad", [0, -1, 129, 2.0, True])
def test_n_out_of_range_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=bad)


# ---------------------------------------------------------------- the engine


PROMPT = list(range(40, 80))  # 40 tokens: 2 full blocks of 16 and 8 more


def make_llm(tiny_models, **kw) -> LLM:
    args = dict(device="cpu", num_kv_blocks=96, max_model_len=256) | kw
    return LLM(model=str(tiny_models("llama-gqa")), **args)


def test_greedy_choices_share_the_prompt_and_equal_n1(tiny_models) -> None:
    llm = make_llm(tiny_models, enable_prefix_caching=False)  # sharing comes from the fork
    one = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [single] = llm.generate([PROMPT], one, use_tqdm=False)
    before = llm.stats().computed_tokens
    assert before == 40 + 7  # the prompt, then 7 decodes (the last token is never computed)
    [out] = llm.generate(
        [PROMPT], SamplingParams(n=4, temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == single.outputs[0].token_ids for c in out.outputs)
    # choice 0 as before; each child: the 8 tokens of the prompt's partial block + 7 decodes
    assert llm.stats().computed_tokens - before == 47 + 3 * (8 + 7)
    assert llm.stats().num_finished == 2  # requests, not choices
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == 96


def test_seeded_choices_each_follow_their_own_stream(tiny_models) -> None:
    llm = make_llm(tiny_models)
    base = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=77, logprobs=2)
    [out] = llm.generate([PROMPT], replace(base, n=3), use_tqdm=False)
    singles = llm.generate(
        [PROMPT] * 3, [replace(base, seed=77 + i) for i in range(3)], use_tqdm=False
    )
    for i, choice in enumerate(out.outputs):
        assert choice.index == i
        assert choice.token_ids == singles[i].outputs[0].token_ids
        assert [lp.token_id for lp in choice.logprobs] == choice.token_ids
        assert [lp.logprob for lp in choice.logprobs] == pytest.approx(
            [lp.logprob for lp in singles[i].outputs[0].logprobs], abs=1e-4
        )
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # three different samples
    llm.engine.kv.check_integrity()


SEEDED = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, seed=5)
PROMPTS = [PROMPT, list(range(3, 20)), list(range(200, 216)), [9] * 33]


def expected_choices(llm: LLM, n: int) -> list[list[list[int]]]:
    """Each prompt's choices as n separate n = 1 requests with seeds seed + i."""
    flat = llm.generate(
        [p for p in PROMPTS for _ in range(n)],
        [replace(SEEDED, seed=SEEDED.seed + i) for _ in PROMPTS for i in range(n)],
        use_tqdm=False,
    )
    return [
        [o.outputs[0].token_ids for o in flat[k * n : (k + 1) * n]] for k in range(len(PROMPTS))
    ]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(max_num_batched_tokens=7),  # chunked prefill: the fork waits for the whole prompt
        dict(num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=64),  # preemption
        dict(async_scheduling=True),
        dict(max_num_seqs=2),  # children past the running cap queue instead of forking
    ],
    ids=["cache", "no-cache", "tiny-budget", "tiny-pool", "async", "two-seqs"],
)
def test_choices_whatever_the_engine_settings(tiny_models, engine_args) -> None:
    want = expected_choices(make_llm(tiny_models), 3)
    llm = make_llm(tiny_models, **engine_args)
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    [alone] = llm.generate([PROMPTS[1]], plain, use_tqdm=False)
    outs = llm.generate(
        PROMPTS + [PROMPTS[1]], [replace(SEEDED, n=3)] * len(PROMPTS) + [plain], use_tqdm=False
    )
    assert [[c.token_ids for c in o.outputs] for o in outs[:-1]] == want
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids  # n = 1 unchanged
    if "num_kv_blocks" in engine_args:
        assert llm.stats().num_preemptions > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_choices_of_one_token_and_stops(tiny_models) -> None:
    """Choice 0 finishing in the step of its first token still forks its children."""
    llm = make_llm(tiny_models)
    outs = llm.generate(
        PROMPTS,
        [
            SamplingParams(n=5, max_tokens=1, seed=3),
            SamplingParams(n=2, temperature=0, stop_token_ids=list(range(512))),
        ]
        * 2,
        use_tqdm=False,
    )
    assert [len(o.outputs) for o in outs] == [5, 2, 5, 2]
    assert all(len(c.token_ids) == 1 for o in outs for c in o.outputs)
    assert all(c.finish_reason == "length" for c in outs[0].outputs)
    assert all(c.finish_reason == "stop" for c in outs[1].outputs)
    llm.engine.kv.check_integrity()


def test_abort_a_request_with_choices(tiny_models) -> None:
    llm = make_llm(tiny_models)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=50, ignore_eos=True), "a")
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=5, ignore_eos=True), "b")
    engine.step()  # prefill: choice 0 of each forks its children
    engine.step()
    engine.abort_request("a")
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [o.request_id for o in done] == ["b"] and len(done[0].outputs) == 2
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # aborted before its children started
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=5), "c")
    engine.abort_request("c")
    assert not engine.has_unfinished()
    engine.kv.check_integrity()


def test_greedy_choices_under_speculation(tiny_models) -> None:
    """Each choice speculates on its own; greedy verification keeps the target's tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = make_llm(tiny_models).generate(PROMPTS, greedy, use_tqdm=False)
    llm = make_llm(tiny_models, speculative="ngram", num_speculative_tokens=3)
    outs = llm.generate(PROMPTS, replace(greedy, n=3), use_tqdm=False)
    for single, out in zip(want, outs):
        assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 3
    assert llm.stats().spec_draft_tokens > 0
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks

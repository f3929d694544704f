"""Speculative decoding end to end on tiny random checkpoints: same tokens as without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.core.config import SpecConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BASE = dict(device="cpu", num_kv_blocks=96, max_model_len=256)
NO_SWITCH = dict(max_batch_size=1024, min_acceptance=0.0)  # speculate whatever happens


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine idle-waiting OpenMP
    threads make each op ~50x slower: one thread keeps these tests fast anywhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def copy_prompts(vocab: int = 512) -> list[list[int]]:
    """Prompts that repeat themselves (n-gram lookup finds matches) and ones that do not, of
    uneven lengths, two sharing a 2-block prefix."""
    g = torch.Generator().manual_seed(11)

    def rand(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    doc, a, b = rand(32), rand(13), rand(21)
    return [doc + doc[:9], doc + a + doc[:5], a + a + a[:4], b, b[:7] + b + b[:3], rand(40)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def noisy_draft(tiny_models, tmp_path_factory):
    """llama-gqa with noise on every weight: a draft that agrees with the target only often."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama-gqa"), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.02 * torch.randn(p.shape, generator=g))  # ~60% first-draft acceptance
    path = tmp_path_factory.mktemp("noisy_draft")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(tiny_models):
    """The engine's own greedy tokens without speculation (it matches transformers:
    tests/engine/core/test_llm.py)."""
    llm = LLM(model=str(tiny_models("llama-gqa")), **BASE)
    return tokens(llm.generate(copy_prompts(), GREEDY, use_tqdm=False))


def _cached_blocks_are_final(llm, outs) -> None:
    """Every block in the prefix cache holds a full block of some request's final tokens at
    that block's place: never a draft token that was rejected."""
    kv, bs = llm.engine.kv, llm.engine.kv.block_size
    final = set()
    for o in outs:
        seq = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        final |= {(i, tuple(seq[i * bs : (i + 1) * bs])) for i in range(len(seq) // bs)}
    for b in kv._cached.values():
        block = kv._blocks[b]
        depth, parent = 0, block.parent
        while parent is not None:
            depth, parent = depth + 1, kv._blocks[parent[0]].parent
        assert (depth, block.tokens) in final


SETTINGS = {
    "cache": dict(),
    "no-cache": dict(enable_prefix_caching=False),
    "tiny-budget": dict(max_num_batched_tokens=7),  # chunked prefill; drafts trimmed to fit
    "tiny-pool": dict(num_kv_blocks=10, max_model_len=128, max_num_batched_tokens=64),  # preempts
}
CASES = [(m, s) for m in ("ngram", "draft-noisy") for s in SETTINGS] + [
    ("draft-self", "cache"),
    ("draft-self", "tiny-pool"),
    ("draft-random", "cache"),
]


@pytest.mark.parametrize(
    "method, engine_args",
    [(m, SETTINGS[s]) for m, s in CASES],
    ids=[f"{m}-{s}" for m, s in CASES],
)
def test_greedy_tokens_are_identical_with_speculation(
    tiny_models, noisy_draft, reference, method, engine_args
):
    target = tiny_models("llama-gqa")
    draft = {
        "draft-noisy": noisy_draft,
        "draft-random": tiny_models("llama-mha"),  # another random model: never agrees
        "draft-self": target,
    }.get(method)
    spec = SpecConfig(
        "draft" if draft else "ngram",
        num_speculative_tokens=4,
        draft_model=str(draft) if draft else None,
        ngram_min=1,
        **NO_SWITCH,
    )
    llm = LLM(model=str(target), **(BASE | engine_args), speculative=spec)
    outs = llm.generate(copy_prompts(), GREEDY, use_tqdm=False)
    assert tokens(outs) == reference
    stats = llm.stats()
    assert stats.spec_draft_tokens > 0
    if method == "draft-self":
        # The target agrees with itself.
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
        assert all(a == 1.0 for a in stats.spec_acceptance_by_position)
    elif method != "draft-random":
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0
    per_request = [o.spec_stats for o in outs if o.spec_stats is not None]
    assert sum(s.num_draft_tokens for s in per_request) == stats.spec_draft_tokens
    assert sum(s.num_accepted_tokens for s in per_request) == stats.spec_accepted_tokens
    llm.engine.kv.check_integrity()
    if engine_args.get("enable_prefix_caching", True):
        _cached_blocks_are_final(llm, outs)
    if draft:
        llm.engine.spec.proposer.kv.check_integrity()
        assert not llm.engine.spec.proposer.states  # finished sequences were released


def test_cache_integrity_holds_after_every_rollback(tiny_models, noisy_draft):
    spec = SpecConfig("draft", 3, draft_model=str(noisy_draft), **NO_SWITCH)
    llm = LLM(model=str(tiny_models("llama-gqa")), **BASE, speculative=spec, block_size=4)
    engine = llm.engine
    for p in copy_prompts()[:4]:
        engine.add_request(p, GREEDY)
    rollbacks = 0
    while engine.has_unfinished():
        before = engine.stats()
        engine.step()
        after = engine.stats()
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        rollbacks += drafted - (after.spec_accepted_tokens - before.spec_accepted_tokens)
        engine.kv.check_integrity()
        engine.spec.proposer.kv.check_integrity()
        for seq in engine.scheduler.running:  # the block tables cover exactly the KV computed
            assert engine.kv.num_computed_tokens(id(seq)) >= seq.num_computed_tokens
            assert not seq.draft_token_ids
    assert rollbacks > 0


def test_stops_inside_an_accepted_run_are_exact(tiny_models, reference):
    """draft == target accepts every draft, so stops land inside accepted runs."""
    path = str(tiny_models("llama-gqa"))
    plain = LLM(model=path, **BASE)
    spec = LLM(model=path, **BASE, speculative=f"draft:{path}", num_speculative_tokens=4)
    seq = reference[0]
    stop_at = next(i for i in range(3, len(seq)) if seq[i] not in seq[:i])
    cases = [
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[seq[stop_at]]),
        SamplingParams(max_tokens=stop_at + 2, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
    ]
    prompt = copy_prompts()[0]
    for params in cases:
        a = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        b = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (b.token_ids, b.finish_reason, b.stop_reason) == (
            a.token_ids,
            a.finish_reason,
            a.stop_reason,
        )
        if params.logprobs:
            assert [lp.token_id for lp in b.logprobs] == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    # One batch: a stop cuts the first request's run; the next one's logprobs stay aligned.
    pair = [cases[0], cases[3]]
    a2 = plain.generate([prompt, copy_prompts()[2]], pair, use_tqdm=False)
    b2 = spec.generate([prompt, copy_prompts()[2]], pair, use_tqdm=False)
    assert tokens(a2) == tokens(b2)
    for x, y in zip(a2[1].outputs[0].logprobs, b2[1].outputs[0].logprobs):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
    # EOS inside a run: pretend a greedy token is the end of sequence.
    for llm in (plain, spec):
        llm.engine.stop_checker.eos = frozenset({seq[stop_at]})
    params = SamplingParams(max_tokens=24, temperature=0)
    a = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert b.token_ids == a.token_ids == seq[: stop_at + 1] and b.finish_reason == "stop"
    assert spec.stats().spec_accepted_tokens > 0
    # At the context limit: 28 + 4 = max_model_len 32.
    short = dict(BASE, max_model_len=32, num_kv_blocks=8)
    p28 = copy_prompts()[1][:28]
    a = LLM(model=path, **short).generate(p28, GREEDY, use_tqdm=False)[0].outputs[0]
    b = LLM(model=path, **short, speculative=f"draft:{path}").generate(p28, GREEDY, use_tqdm=False)
    assert b[0].outputs[0].token_ids == a.token_ids and len(a.token_ids) == 4


def test_sampled_outputs_follow_the_targets_distribution(tiny_models, noisy_draft):
    """Two-sample chi-square: the 2nd and 3rd sampled tokens of many seeded requests, with and
    without a poor draft (a random model with the same vocabulary)."""
    path = str(tiny_models("llama-gqa"))
    prompt = copy_prompts()[2]
    n = 300
    params = [
        SamplingParams(max_tokens=3, temperature=1.5, top_k=8, seed=s, ignore_eos=True)
        for s in range(n)
    ]
    kw = dict(BASE, num_kv_blocks=400, max_num_seqs=n)
    plain = tokens(LLM(model=path, **kw).generate([prompt] * n, params, use_tqdm=False))
    spec = SpecConfig("draft", 2, draft_model=str(noisy_draft), **NO_SWITCH)
    llm = LLM(model=path, **kw, speculative=spec)
    drafted = tokens(llm.generate([prompt] * n, params, use_tqdm=False))
    assert llm.stats().spec_draft_tokens > 0 and llm.stats().spec_accepted_tokens > 0
    for pos in (1, 2):
        a = np.array([t[pos] for t in plain])
        b = np.array([t[pos] for t in drafted])
        values = sorted(set(a) | set(b))
        table = np.array([[np.sum(a == v) for v in values], [np.sum(b == v) for v in values]])
        # Pool the rare tokens so every cell's expected count is reasonable.
        common = table.sum(0) >= 10
        table = np.column_stack([table[:, common], table[:, ~common].sum(1)])
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, (pos, table)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_sampling_with_speculation_is_reproducible(tiny_models, noisy_draft, method):
    """A seeded request's tokens do not depend on the engine's seed (its generator) or on
    the batch it runs in, with n-gram drafts or drafts sampled from a draft model."""
    path = str(tiny_models("llama-gqa"))
    prompts = copy_prompts()[:3]
    spec = SpecConfig("ngram", ngram_min=1) if method == "ngram" else f"draft:{noisy_draft}"
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    other = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    runs = []
    for seed, batch in ((0, prompts), (1, prompts[:1])):
        llm = LLM(model=path, **BASE, speculative=spec, seed=seed)
        outs = llm.generate(batch, [params] + [other] * (len(batch) - 1), use_tqdm=False)
        runs.append(outs[0].outputs[0].token_ids)
        assert llm.stats().spec_draft_tokens > 0
    assert runs[0] == runs[1]


def test_a_draft_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import tiny_config

    config = tiny_config("llama-gqa")
    config.vocab_size = 256
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "small-vocab")
    with pytest.raises(ValueError, match="vocabulary of 256 tokens.*same model family"):
        LLM(
            model=str(tiny_models("llama-gqa")),
            **BASE,
            speculative=f"draft:{tmp_path / 'small-vocab'}",
        )


def test_triton_backend_verifies_drafts_too(tiny_models, reference):
    """Speculative chunks go through the triton backend's prefill-with-context path (on the
    CPU under the Triton interpreter): same tokens, every draft of the model itself accepted."""
    path = str(tiny_models("llama-gqa"))
    llm = LLM(
        model=path,
        **BASE,
        dtype="float32",
        attention_backend="triton",
        speculative=f"draft:{path}",
        num_speculative_tokens=3,
    )
    outs = llm.generate(copy_prompts()[:2], GREEDY, use_tqdm=False)
    assert tokens(outs) == reference[:2]
    stats = llm.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    llm.engine.kv.check_integrity()


def test_the_kv_budget_pays_for_the_drafts_pool_too(tiny_models):
    """A draft keeps as many blocks as the target: with a byte budget both pools fit in it
    (on CUDA the budget is what the profile leaves, so two full pools would not fit)."""
    from kvbatch.engine.exec.runner import kv_bytes_per_block

    target = tiny_models("llama-gqa")
    budget = 400_000
    plain = LLM(model=str(target), device="cpu", max_model_len=256, kv_cache_bytes=budget)
    per_block = kv_bytes_per_block(plain.engine.model, 16, torch.float32)
    assert plain.engine.kv.num_blocks == budget // per_block
    spec = LLM(
        model=str(target),
        device="cpu",
        max_model_len=256,
        kv_cache_bytes=budget,
        speculative=f"draft:{target}",
    )
    draft = spec.engine.spec.proposer
    assert spec.engine.kv.num_blocks == draft.kv.num_blocks == budget // (2 * per_block)
    pools = spec.engine.runner.kv_caches + draft.runner.kv_caches
    assert sum(t.numel() * t.element_size() for t in pools) <= budget

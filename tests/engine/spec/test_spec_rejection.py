"""The rejection sampler, the n-gram lookup and the speculation policy, without a model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kvbatch.engine.core.config import SchedulerConfig, SpecConfig
from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.core.sequence import Sequence
from kvbatch.engine.exec.sampler import Sampler
from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.sched.scheduler import Scheduler
from kvbatch.engine.spec.decoder import SpecDecoder
from kvbatch.engine.spec.ngram import ngram_propose
from kvbatch.engine.spec.rejection import rejection_sample, seeded_uniform, verify


def _draws(target, draft_q, trials, seed, one_hot_draft=None):
    """Run `trials` independent verifications of k drafts in one batch; returns the emitted
    tokens [trials, k + 1] (-1 where nothing was emitted) and the accepted counts."""
    g = torch.Generator().manual_seed(seed)
    k1, vocab = target.shape
    k = k1 - 1
    if one_hot_draft is None:
        drafts = torch.stack(
            [
                torch.multinomial(draft_q[j], trials, replacement=True, generator=g)
                for j in range(k)
            ],
            dim=1,
        )
        q = draft_q[None].expand(trials, k, vocab)
    else:
        drafts = torch.tensor(one_hot_draft).expand(trials, k)
        q = None
    out = rejection_sample(
        target[None].expand(trials, k1, vocab),
        drafts,
        torch.full((trials,), k),
        q,
        torch.rand(trials, k, dtype=torch.float64, generator=g),
        lambda at: torch.empty(trials, vocab).exponential_(generator=g),
    )
    emitted = torch.full((trials, k1), -1)
    for j in range(k1):
        if j < k:
            take = out.num_accepted > j
            emitted[take, j] = drafts[take, j]
        emitted[out.num_accepted == j, j] = out.token_ids[out.num_accepted == j]
    return emitted, out.num_accepted


def _assert_follows(tokens, p, what):
    tokens = tokens[tokens >= 0]
    observed = np.bincount(tokens.numpy(), minlength=len(p))
    p = p.double().numpy()
    expected = p / p.sum() * len(tokens)
    keep = expected > 0
    assert observed[~keep].sum() == 0, f"{what}: a token of probability 0 was emitted"
    expected = expected[keep] * observed[keep].sum() / expected[keep].sum()
    stat, pvalue = chisquare(observed[keep], expected)
    assert pvalue > 1e-3, f"{what}: chi-square p={pvalue:.2e}, observed {observed}"


@pytest.mark.parametrize("draft", ["poor-q", "one-hot"])
def test_emitted_tokens_follow_the_target_whatever_the_draft(draft):
    k = 3
    target = torch.tensor(
        [
            [0.40, 0.30, 0.15, 0.10, 0.05, 0.00],
            [0.05, 0.05, 0.10, 0.20, 0.25, 0.35],
            [0.50, 0.00, 0.00, 0.25, 0.25, 0.00],
            [1 / 6] * 6,
        ]
    )
    # A deliberately poor draft: mass where the target has little, some where it has none.
    poor = torch.tensor([0.02, 0.03, 0.05, 0.1, 0.3, 0.5])
    draft_q = torch.stack([poor, poor.flip(0), poor])
    one_hot = [0, 5, 0] if draft == "one-hot" else None
    emitted, accepted = _draws(target, draft_q, 40_000, seed=3, one_hot_draft=one_hot)
    assert 0 < accepted.float().mean() < k  # some accepted, some rejected
    for j in range(k + 1):
        _assert_follows(emitted[:, j], target[j], f"position {j}")


def test_a_perfect_draft_is_always_accepted_and_gets_a_bonus_token():
    target = torch.tensor([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]])
    _, accepted = _draws(target, target[:2], 4_000, seed=1)
    assert (accepted == 2).all()


def test_greedy_rows_accept_while_the_argmax_matches():
    target = torch.tensor([[[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]]] * 2)
    drafts = torch.tensor([[1, 0], [1, 2]])
    out = rejection_sample(
        target,
        drafts,
        torch.tensor([2, 2]),
        None,
        torch.full((2, 2), 0.999, dtype=torch.float64),  # a sampler would reject nearly all
        lambda at: torch.ones(2, 3),
        greedy=torch.tensor([True, True]),
    )
    assert out.num_accepted.tolist() == [2, 1]
    assert out.token_ids.tolist() == [2, 0]  # the bonus argmax; the argmax at the rejection


def _seq(tokens, drafts, params, name="a"):
    s = Sequence(name, list(tokens), params)
    s.draft_token_ids = list(drafts)
    return s


def test_verify_greedy_matches_argmax_and_reports_logprobs():
    logits = torch.tensor(
        [
            [0.0, 3.0, 1.0, 0.0],  # seq a: row of its last token -> argmax 1 (= draft 1)
            [2.0, 0.0, 1.0, 0.0],  # after draft 1 -> 0, but draft says 3: reject, emit 0
            [0.0, 0.0, 0.0, 5.0],
            [0.0, 0.0, 4.0, 0.0],  # seq b: no drafts -> 2
        ]
    )
    params = SamplingParams(temperature=0, logprobs=1)
    seqs = [_seq([9], [1, 3], params, "a"), _seq([9], [], params, "b")]
    tokens, out = verify(Sampler(seed=0), logits, seqs, 4)
    assert tokens == [[1, 0], [2]]
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs.tolist() == pytest.approx(
        [raw[0, 1].item(), raw[1, 0].item(), raw[3, 2].item()]
    )


def test_seeded_verification_is_reproducible_and_uniforms_cover_the_unit_interval():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=77)
    runs = []
    for sampler_seed in (1, 2):  # the sampler's own generator must not matter for seeded rows
        seqs = [_seq([5, 6], [3, 4, 7], params, "a"), _seq([5], [8], params, "b")]
        runs.append(verify(Sampler(seed=sampler_seed), logits, seqs, 50)[0])
    assert runs[0] == runs[1]
    u = seeded_uniform(torch.arange(20_000), torch.zeros(20_000, dtype=torch.long))
    assert u.dtype == torch.float64 and 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01


# -- n-gram lookup ----------------------------------------------------------------------------


def test_ngram_finds_the_longest_latest_match_and_proposes_what_followed():
    seqs = [
        [1, 2, 3, 4, 5, 9, 9, 1, 2, 3],  # "1 2 3" seen before: propose 4 5 9
        [7, 8, 1, 7, 8, 2, 7, 8],  # "7 8" twice: the latest (followed by 2) wins
        [1, 2, 3, 4],  # nothing repeats
        [5, 6, 5, 6],  # "5 6" at 0: only 2 tokens follow
        [4, 4, 4],
    ]
    out = ngram_propose(seqs, [3, 2, 3, 4, 2], min_n=2, max_n=3)
    assert out == [[4, 5, 9], [2, 7], [], [5, 6], [4]]
    # min_n=1 finds single-token matches; a window hides older tokens.
    assert ngram_propose([[3, 1, 2, 3]], [2], 1, 3) == [[1, 2]]
    assert ngram_propose([[3, 1, 2, 3]], [2], 1, 3, window=3) == [[]]


# -- policy -----------------------------------------------------------------------------------


class _Recorder:
    def __init__(self):
        self.calls = []

    def propose(self, picks, step):
        self.calls.append([(s.request_id, k) for s, k in picks])
        for s, k in picks:
            s.draft_token_ids = [0] * k

    def release(self, seq):
        pass


def _running(n, max_tokens=10, prompt=5):
    seqs = []
    for i in range(n):
        s = Sequence(str(i), list(range(prompt)), SamplingParams(max_tokens=max_tokens))
        s.num_computed_tokens = prompt - 1
        s.status = s.status.RUNNING
        seqs.append(s)
    return seqs


def test_policy_switches_off_large_batches_low_acceptance_and_stays_inside_limits():
    rec = _Recorder()
    spec = SpecDecoder(SpecConfig(num_speculative_tokens=4, max_batch_size=2), rec, 8)
    assert spec.propose(_running(3), step=0) == 0  # 3 decodes > max_batch_size 2
    a, b = _running(2)
    b.token_ids += [1, 1]  # 7 tokens of max_model_len 8: room for one token, no drafts
    b.num_computed_tokens = 6
    assert spec.propose([a, b], step=0) == 1 and rec.calls[-1] == [("0", 2)]  # 8 - 5 - 1
    for step in range(3):  # acceptance 0: EWMA 0.5, 0.25, 0.125 -> off after the third
        spec.observe(a, 2, 0, 0, step)
    assert a.spec_resume_step == 3 + SpecConfig().backoff_steps
    assert spec.propose([a], step=5) == 0 and spec.propose([a], step=a.spec_resume_step) == 1
    assert a.spec_stats.num_draft_tokens == 6 and a.spec_stats.num_rejected_tokens == 6
    # A middling acceptance is enough alone, not in a batch (0.6 needed at max_batch_size).
    a.spec_acceptance = 0.5
    assert spec.propose([a], step=100) == 1 and spec.propose([a, b], step=100) == 0


def test_spec_config_parsing_names_the_fix():
    assert SpecConfig.parse("ngram", 3) == SpecConfig("ngram", 3)
    assert SpecConfig.parse("draft:/m").draft_model == "/m"
    assert SpecConfig.parse(None) is None
    for bad, match in [("medusa", "ngram' or 'draft:PATH"), ("draft:", "draft:PATH")]:
        with pytest.raises(ValueError, match=match):
            SpecConfig.parse(bad)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecConfig.parse("ngram", 0)
    with pytest.raises(ValueError, match="needs speculative"):
        SpecConfig.parse(None, 4)


# -- scheduler and KV cache -------------------------------------------------------------------


def test_drafts_count_against_the_budget_and_rejected_slots_are_released():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4), kv)
    seq = Sequence("a", [10, 11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=20))
    sched.add(seq)
    sched.advance(sched.schedule())  # prefill 4 of 7
    sched.advance(sched.schedule())  # the other 3
    seq.token_ids.append(17)  # sampled: 8 tokens, 7 computed
    seq.draft_token_ids = [18, 19, 20, 21, 22]
    out = sched.schedule()
    assert out.chunks[0].num_new_tokens == 4 and seq.draft_token_ids == [18, 19, 20]
    assert out.chunks[0].samples and len(kv.block_table(id(seq))) == 3  # 11 slots
    sched.advance(out)
    assert seq.num_computed_tokens == 8  # the drafts' KV is not final yet
    seq.token_ids += [18, 99]  # draft 18 accepted, then the target's own token
    sched.accept_drafts(seq, 1)
    assert seq.num_computed_tokens == 9 and seq.draft_token_ids == []
    assert len(kv.block_table(id(seq))) == 3  # 9 tokens: blocks 0-1 full, 1 slot in block 2
    # Only full blocks of final tokens are cached: [10..13], [14..17]; never a draft.
    cached = {kv._blocks[b].tokens for b in kv._cached.values()}
    assert cached == {(10, 11, 12, 13), (14, 15, 16, 17)}
    kv.check_integrity()
    with pytest.raises(ValueError):
        kv.truncate(id(seq), seq.token_ids, 7)  # into a cached block


def test_drafts_are_dropped_before_anyone_is_preempted():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    seq = Sequence("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=20))
    sched.add(seq)
    sched.advance(sched.schedule())
    seq.token_ids.append(8)
    seq.draft_token_ids = [9, 10]  # would need a third block
    out = sched.schedule()
    assert out.num_preempted == 0 and out.chunks[0].num_new_tokens == 1
    assert seq.draft_token_ids == []
    kv.check_integrity()

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.exec.sampler import Sampler, SamplingTensors, seeded_exponential

V = 6
LOGITS = [1.2, -0.4, 0.3, 2.0, -1.5, 0.8]  # softmax(/0.7) = .196 .020 .054 .615 .004 .111
TEMP = 0.7
N_DRAWS = 12_000
# Chi-square critical values at p = 0.001, by degrees of freedom (no scipy in the venv).
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 9: 27.877}


def tensors(
    params: Sequence[SamplingParams], vocab_size: int, offsets: Sequence[int] | None = None
) -> SamplingTensors:
    offsets = [0] * len(params) if offsets is None else offsets
    return SamplingTensors.from_params(params, offsets, vocab_size, "cpu")


def random_logits(rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- SamplingTensors


def test_from_params_fields_and_flags() -> None:
    params = [
        SamplingParams(temperature=0, top_k=3, seed=9),  # greedy: its options raise no flag
        SamplingParams(temperature=0.5, top_k=1),  # greedy through top_k
        SamplingParams(temperature=0.8, top_k=50, seed=4, logprobs=2),
        SamplingParams(top_p=0.9, min_p=0.1, top_k=-1, logprobs=5),
    ]
    t = SamplingTensors.from_params(params, [0, 1, 2, 7], 10, "cpu")
    assert t.temperature.dtype == torch.float32 and t.top_k.dtype == torch.int64
    assert t.temperature.tolist() == [0.0, 0.0, pytest.approx(0.8), 1.0]
    assert t.top_k.tolist() == [3, 1, 10, 10]  # 50 >= vocab and -1 both mean disabled
    assert t.seeds.tolist() == [9, -1, 4, -1]
    assert t.offsets.tolist() == [0, 1, 2, 7]
    assert t.seeded_rows.tolist() == [2]  # row 0 is greedy: it never reads noise
    assert (t.all_greedy, t.any_greedy) == (False, True)
    assert (t.need_top_k, t.need_top_p, t.need_min_p) == (False, True, True)
    assert (t.any_seeded, t.any_unseeded) == (True, True)
    assert t.max_num_logprobs == 5

    t = tensors([SamplingParams(temperature=0, top_p=0.5)] * 2, 10)
    assert t.all_greedy and t.any_greedy and not t.need_top_p and t.max_num_logprobs == -1


def test_from_params_length_mismatch() -> None:
    with pytest.raises(ValueError, match="output_lens"):
        SamplingTensors.from_params([SamplingParams()], [0, 1], 10, "cpu")


# ---------------------------------------------------------------- greedy


def test_greedy_equals_argmax_with_ties() -> None:
    logits = random_logits(64, 1000)
    logits[::4, 10] = logits[::4, 500] = 1e3  # ties: torch.argmax takes the lowest index
    t = tensors([SamplingParams(temperature=0)] * 64, 1000)
    out = Sampler()(logits, t)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert (out.token_ids[::4] == 10).all()
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


def test_argmax_fast_path_equals_the_full_sampler_for_argmax_only_rows() -> None:
    logits = random_logits(64, 1000, seed=3)
    logits[::4, 10] = logits[::4, 500] = 1e3
    for params in (SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=0.8)):
        assert params.argmax_only
        full = Sampler()(logits, tensors([params] * 64, 1000))
        assert torch.equal(Sampler.argmax(logits).token_ids, full.token_ids)
        assert torch.equal(
            Sampler.argmax(logits.to(torch.bfloat16)).token_ids[::4], full.token_ids[::4]
        )
    # rows that need more than the argmax
    assert not SamplingParams(temperature=0, logprobs=2).argmax_only
    assert not SamplingParams(temperature=0.5).argmax_only


def test_mixed_batch_leaves_greedy_rows_exact() -> None:
    rows = 48
    logits = random_logits(rows, 500, seed=1)
    logits[::3, 7] = logits[::3, 8] = 1e3
    options = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5, top_k=20, top_p=0.8, seed=5),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=2.0, top_k=1),  # greedy through top_k
    ]
    params = [options[i % 4] for i in range(rows)]
    out = Sampler(seed=0)(logits, tensors(params, 500))
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(out.token_ids[greedy], logits.argmax(-1)[greedy])
    # Sampled rows at temperature 1.5-2 over 500 tokens do not all land on the argmax.
    assert not torch.equal(out.token_ids[~greedy], logits.argmax(-1)[~greedy])


def test_empty_batch() -> None:
    out = Sampler()(torch.empty(0, 10), tensors([], 10))
    assert out.token_ids.shape == (0,)


# ---------------------------------------------------------------- seeds


def test_seeded_token_independent_of_batch_and_position() -> None:
    vocab = 300
    row = random_logits(1, vocab, seed=2)[0]
    mine = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)
    alone = Sampler(seed=1)(row[None], tensors([mine], vocab, [17])).token_ids.item()

    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.9),
        SamplingParams(seed=99, top_k=5, min_p=0.2),
        SamplingParams(temperature=1.1, top_p=0.5),
    ]
    for trial in range(6):
        batch = 2 + trial
        pos = trial % batch
        params = [others[(trial + i) % len(others)] for i in range(batch)]
        params[pos] = mine
        logits = random_logits(batch, vocab, seed=10 + trial)
        logits[pos] = row
        offsets = [3 * i + trial for i in range(batch)]
        offsets[pos] = 17
        out = Sampler(seed=trial)(logits, tensors(params, vocab, offsets))
        assert out.token_ids[pos].item() == alone


def test_different_seeds_and_offsets_give_different_tokens() -> None:
    vocab = 1000
    logits = torch.zeros(500, vocab)  # uniform: tokens are the noise's argmax
    by_seed = Sampler()(logits, tensors([SamplingParams(seed=s) for s in range(500)], vocab))
    by_offset = Sampler()(logits, tensors([SamplingParams(seed=7)] * 500, vocab, range(500)))
    # 500 uniform draws over 1000 tokens: ~390 distinct on average.
    assert len(set(by_seed.token_ids.tolist())) > 350
    assert len(set(by_offset.token_ids.tolist())) > 350


def test_neighbouring_seeds_are_unrelated() -> None:
    seeds = torch.tensor([0, 1, 2, 2**32, 2**32 + 1, 2**63 - 1])
    noise = seeded_exponential(seeds, torch.zeros_like(seeds), 20_000).double()
    corr = torch.corrcoef(noise)
    off_diag = corr[~torch.eye(len(seeds), dtype=torch.bool)]
    assert off_diag.abs().max() < 0.04  # ~0.007 standard error for 20k samples
    near = seeded_exponential(torch.tensor([5, 5]), torch.tensor([0, 1]), 20_000).double()
    assert torch.corrcoef(near)[0, 1].abs() < 0.04


def test_unseeded_rows_reproducible_with_sampler_seed() -> None:
    logits = torch.zeros(200, 100)
    t = tensors([SamplingParams()] * 200, 100)
    a = Sampler(seed=123)(logits, t).token_ids
    b = Sampler(seed=123)(logits, t).token_ids
    c = Sampler(seed=124)(logits, t).token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


M32 = 0xFFFFFFFF


def _mix32_ref(x: int) -> int:
    """lowbias32 in plain Python ints, with the hash's canonical (unsigned) constants."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _seeded_exponential_ref(seed: int, offset: int, token: int) -> float:
    key = _mix32_ref((seed & M32) ^ 0x9E3779B9)
    key = _mix32_ref(key ^ (seed >> 32))
    key = _mix32_ref(key ^ offset)
    key2 = _mix32_ref(key ^ 0x85EBCA6B)
    x = _mix32_ref(_mix32_ref(token ^ key) ^ key2)
    return -math.log((x + 0.5) / 2**32)


def test_seeded_noise_matches_python_reference() -> None:
    """Integer-exact against unbounded Python ints: no int64 overflow anywhere."""
    seeds = torch.tensor([0, 1, 42, 2**31 + 5, 2**32 - 1, 2**62 + 3, 2**63 - 1])
    offsets = torch.tensor([0, 5, 1, 2**31 - 1, 4096, 77, 3])
    tokens = [0, 1, 2, 12_345, 151_935]
    noise = seeded_exponential(seeds, offsets, 151_936)
    for r, (s, o) in enumerate(zip(seeds.tolist(), offsets.tolist())):
        for tok in tokens:
            ref = _seeded_exponential_ref(s, o, tok)
            assert noise[r, tok].item() == pytest.approx(ref, rel=1e-6)
    # Pinned values: a change to the hash changes every seeded request's output.
    assert noise[2, :3].tolist() == pytest.approx([1.7603265, 0.8760182, 0.3249946], rel=1e-6)


def test_seeded_noise_is_exp1() -> None:
    """u = exp(-E) must be uniform on (0, 1): chi-square over 10 bins, and mean(E) = 1."""
    seeds = torch.arange(200)
    noise = seeded_exponential(seeds, seeds * 3, 1000).double()  # 200k draws
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert noise.mean().item() == pytest.approx(1.0, abs=0.01)  # std error ~0.0022
    counts = torch.histc(torch.exp(-noise), bins=10, min=0.0, max=1.0).numpy()
    expected = noise.numel() / 10
    assert ((counts - expected) ** 2 / expected).sum() < CHI2_CRIT_001[9]


# ---------------------------------------------------------------- distribution


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _expected(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Target distribution computed independently of the sampler, in numpy float64."""
    p = _softmax(np.array(LOGITS) / TEMP)
    order = np.argsort(-p)
    if top_k:
        p[order[top_k:]] = 0.0
        p /= p.sum()
    if top_p < 1.0:
        before = np.cumsum(p[order]) - p[order]  # mass strictly before each sorted token
        p[order[before >= top_p]] = 0.0
        p /= p.sum()
    if min_p:
        p[p < min_p * p.max()] = 0.0
        p /= p.sum()
    return p


CASES = {
    "temperature": ({}, 6),
    "top_k": ({"top_k": 3}, 3),
    "top_p": ({"top_p": 0.95}, 4),
    "min_p": ({"min_p": 0.05}, 4),
    # top-p renormalised over the top-4: excludes token 5 (it would stay without renormalising).
    "top_k_top_p": ({"top_k": 4, "top_p": 0.82}, 2),
}


@pytest.mark.parametrize("noise", ["generator", "seeds", "offsets"])
@pytest.mark.parametrize("case", list(CASES))
def test_distribution_chi_square(case: str, noise: str) -> None:
    options, support_size = CASES[case]
    expected = _expected(**options)
    assert (expected > 0).sum() == support_size  # the case exercises what it claims

    if noise == "generator":
        params = [SamplingParams(temperature=TEMP, **options)] * N_DRAWS
        offsets = [0] * N_DRAWS
    elif noise == "seeds":  # many different seeds at one offset
        params = [SamplingParams(temperature=TEMP, seed=s, **options) for s in range(N_DRAWS)]
        offsets = [0] * N_DRAWS
    else:  # one seed, many offsets: one request's successive draws
        params = [SamplingParams(temperature=TEMP, seed=2024, **options)] * N_DRAWS
        offsets = list(range(N_DRAWS))
    logits = torch.tensor(LOGITS).expand(N_DRAWS, V)
    tokens = Sampler(seed=0)(logits, tensors(params, V, offsets)).token_ids
    counts = np.bincount(tokens.numpy(), minlength=V)

    assert counts[expected == 0].sum() == 0, f"excluded tokens drawn: {counts}"
    kept = expected > 0
    exp_counts = expected[kept] * N_DRAWS
    chi2 = ((counts[kept] - exp_counts) ** 2 / exp_counts).sum()
    assert chi2 < CHI2_CRIT_001[support_size - 1], f"chi2={chi2:.1f} counts={counts}"


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_logits() -> None:
    vocab = 200
    logits = random_logits(8, vocab, seed=3)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, logprobs=0),
        SamplingParams(temperature=1.5, top_p=0.5, seed=1),  # no logprobs: uses a prefix anyway
        SamplingParams(min_p=0.3, logprobs=2),
    ] * 2
    out = Sampler(seed=0)(logits, tensors(params, vocab))
    raw = torch.log_softmax(logits.double(), -1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32 and out.top_ids.dtype == torch.int64
    chosen = raw.gather(-1, out.token_ids[:, None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs.double(), chosen, rtol=0, atol=1e-5)

    assert out.top_ids.shape == out.top_logprobs.shape == (8, 5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    ref_vals, ref_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.top_ids, ref_ids)
    torch.testing.assert_close(out.top_logprobs.double(), ref_vals, rtol=0, atol=1e-5)
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))


def test_logprobs_zero_gives_only_the_chosen_token() -> None:
    logits = random_logits(3, 50, seed=4)
    out = Sampler(seed=0)(logits, tensors([SamplingParams(logprobs=0)] * 3, 50))
    assert out.logprobs is not None and out.logprobs.shape == (3,)
    assert out.top_ids is not None and out.top_ids.shape == (3, 0)

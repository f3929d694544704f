"""Penalties and logit_bias against transformers' logits processors, alone and end to end."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.exec.penalties import TokenHistory
from kvbatch.engine.exec.sampler import Sampler, SamplingTensors, process_logits
from tests.reference import hf_model

V = 300


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def random_history(seed: int, prompt_len: int, output_len: int) -> TokenHistory:
    g = torch.Generator().manual_seed(seed)
    # a narrow id range so that tokens repeat and counts above 1 occur
    prompt = torch.randint(0, 40, (prompt_len,), generator=g).tolist()
    output = torch.randint(20, 60, (output_len,), generator=g).tolist()
    return TokenHistory(prompt, output)


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented formula over the generated tokens, as a transformers processor:
    logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            for token in set(ids[self.prompt_len :]):
                count = ids[self.prompt_len :].count(token)
                scores[row, token] -= count * self.frequency + self.presence
        return scores


def reference(logits: torch.Tensor, params: SamplingParams, h: TokenHistory) -> torch.Tensor:
    """One row through transformers' processors, in the sampler's order (bias, repetition,
    frequency and presence)."""
    ids = torch.tensor([list(h.prompt_token_ids) + list(h.output_token_ids)])
    scores = logits[None].clone()
    if params.logit_bias:
        bias = [[[t], b] for t, b in params.logit_bias.items()]
        scores = SequenceBiasLogitsProcessor(bias)(ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    scores = OpenAIPenalties(
        len(h.prompt_token_ids), params.presence_penalty, params.frequency_penalty
    )(ids, scores)
    return scores[0]


MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.7),
    SamplingParams(temperature=0.8, repetition_penalty=0.6, seed=3),  # < 1 favours repeats
    SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(temperature=0, presence_penalty=2.0),
    SamplingParams(temperature=0, logit_bias={5: 100, "7": -100, 250: 3.5}),
    SamplingParams(
        temperature=0.5,
        repetition_penalty=1.3,
        frequency_penalty=-1.1,
        presence_penalty=0.9,
        logit_bias={25: -2.0, 30: 1.25},
    ),
    SamplingParams(seed=11, top_k=20),
]


def test_processed_logits_match_transformers_processors() -> None:
    logits = random_logits(len(MIXED))
    histories = [random_history(i, 5 + 7 * i, 3 * i) for i in range(len(MIXED))]
    t = SamplingTensors.from_params(MIXED, [0] * len(MIXED), V, "cpu", histories=histories)
    assert t.penalties is not None and t.logit_bias is not None
    assert t.penalties.rows.tolist() == [1, 2, 3, 4, 6]
    assert t.penalties.seen is not None  # some rows have a repetition penalty
    got = process_logits(logits.clone(), t)
    for i, (p, h) in enumerate(zip(MIXED, histories)):
        torch.testing.assert_close(got[i], reference(logits[i], p, h), rtol=1e-6, atol=1e-5)
    # untouched rows are bit for bit what came in
    assert torch.equal(got[0], logits[0]) and torch.equal(got[7], logits[7])


def test_batch_without_options_builds_and_changes_nothing() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(seed=4), SamplingParams()]
    t = SamplingTensors.from_params(params, [0, 1, 2], V, "cpu")
    assert not t.processes_logits
    assert t.penalties is None and t.logit_bias is None and t.token_bitmask is None
    assert all(not p.processes_logits for p in params)
    assert SamplingParams(temperature=0).argmax_only


def test_penalty_rows_need_histories() -> None:
    with pytest.raises(ValueError, match="histories"):
        SamplingTensors.from_params([SamplingParams(presence_penalty=1.0)], [0], V, "cpu")


def test_sampler_uses_processed_logits_and_reports_raw_logprobs() -> None:
    logits = random_logits(2, seed=5)
    top = int(logits[0].argmax())
    params = [
        SamplingParams(temperature=0, logit_bias={top: -100}, logprobs=2),
        SamplingParams(temperature=0, logit_bias={17: 100}, logprobs=1),
    ]
    h = [TokenHistory([1], [])] * 2
    out = Sampler()(logits, SamplingTensors.from_params(params, [0, 0], V, "cpu", histories=h))
    assert out.token_ids[0].item() != top and out.token_ids[1].item() == 17
    raw = torch.log_softmax(logits, dim=-1)
    # vLLM's default: logprobs of the model's own distribution, before any processing
    assert out.top_ids[0, 0].item() == top
    torch.testing.assert_close(out.logprobs[1], raw[1, 17])


def test_seeded_sampling_follows_the_biased_distribution() -> None:
    logits = torch.zeros(1, V)  # uniform: the bias alone decides
    params = SamplingParams(seed=0, logit_bias={3: 5.0, 4: 5.0})
    hits = 0
    sampler = Sampler()
    for offset in range(400):
        t = SamplingTensors.from_params([params], [offset], V, "cpu")
        hits += sampler(logits, t).token_ids.item() in (3, 4)
    # p(3 or 4) = 2e^5 / (2e^5 + 298) = 0.4989
    assert 160 < hits < 240


# ---------------------------------------------------------------- end to end


def hf_generate(path, prompts, max_new_tokens, processors=(), **kw) -> list[list[int]]:
    """transformers' greedy tokens with generation options (EOS ignored)."""
    model = hf_model(path)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                logits_processor=LogitsProcessorList(
                    [f(len(prompt)) if callable(f) else f for f in processors]
                ),
                **kw,
            )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


PROMPTS = [[5, 9, 9, 14, 3], [200, 201, 202, 203] * 5, [7] * 19, list(range(40, 80))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(
        model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=96, max_model_len=256
    )


def greedy_tokens(llm, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_repetition_penalty_matches_transformers_generate(llm, tiny_models) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    want = hf_generate(tiny_models("llama-gqa"), PROMPTS, 16, repetition_penalty=1.8)
    assert greedy_tokens(llm, params) == want
    assert want != hf_generate(tiny_models("llama-gqa"), PROMPTS, 16)  # the penalty bites
    llm.engine.kv.check_integrity()


def test_frequency_and_presence_penalties_match_openai_formula(llm, tiny_models) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5
    )
    processor = lambda prompt_len: OpenAIPenalties(prompt_len, 0.5, 1.5)
    want = hf_generate(tiny_models("llama-gqa"), PROMPTS, 16, processors=[processor])
    assert greedy_tokens(llm, params) == want
    assert want != hf_generate(tiny_models("llama-gqa"), PROMPTS, 16)


def test_logit_bias_matches_sequence_bias(llm, tiny_models) -> None:
    plain = hf_generate(tiny_models("llama-gqa"), PROMPTS, 16)
    banned = plain[0][0]
    bias = {banned: -100.0, 300: 4.0, 301: 4.0}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=bias)
    want = hf_generate(
        tiny_models("llama-gqa"),
        PROMPTS,
        16,
        sequence_bias=[[[t], b] for t, b in bias.items()],
    )
    got = greedy_tokens(llm, params)
    assert got == want
    assert all(banned not in out for out in got)


def test_requests_without_options_are_unchanged_beside_them(llm) -> None:
    plain = [GREEDY, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=42)]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], plain, use_tqdm=False)]
    mixed_params = plain + [
        SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.5, seed=1),
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=0, logit_bias={9: 50}),
    ]
    mixed = llm.generate(PROMPTS[:2] * 2, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert all(t == 9 for t in mixed[3].outputs[0].token_ids)  # +50 on one token wins
    llm.engine.kv.check_integrity()


def test_logit_bias_outside_the_vocabulary_is_refused(llm) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias names token id"):
        llm.engine.add_request([1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(presence_penalty=2.5), "presence_penalty must be"),
        (dict(frequency_penalty=-3), "frequency_penalty must be"),
        (dict(frequency_penalty="1"), "frequency_penalty must be"),
        (dict(repetition_penalty=0), "repetition_penalty must be"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be"),
        (dict(logit_bias={1: 101}), r"logit_bias\[1\] must be"),
        (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
        (dict(logit_bias={-1: 1}), "logit_bias keys must be token ids"),
        (dict(logit_bias=[(1, 2)]), "logit_bias must be a mapping"),
    ],
)
def test_bad_options_are_refused_with_the_fix(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_options_are_normalised() -> None:
    p = SamplingParams(logit_bias={"50256": -100, 3: 2}, presence_penalty=1, repetition_penalty=2)
    assert p.logit_bias == {50256: -100.0, 3: 2.0}
    assert p.presence_penalty == 1.0 and type(p.repetition_penalty) is float
    assert p.uses_penalties and p.processes_logits and not p.argmax_only
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_async_scheduling_counts_every_token(tiny_models, llm) -> None:
    """With steps overlapped a sampled token reaches the host a step late; requests with
    penalties pause the overlap, so their counts miss no token."""
    params = [
        # without the penalty the output repeats token 9; with it, 9 comes back only once
        # its count is known the step it is sampled
        SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, logit_bias={9: 6}, frequency_penalty=2
        ),
        SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.4, seed=8),
        GREEDY,
        # a bias alone needs no history: these steps may overlap
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={9: 3}),
    ]
    assert [p.needs_host_tokens for p in params] == [True, True, False, False]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    overlapped = LLM(
        model=str(tiny_models("llama-gqa")),
        device="cpu",
        num_kv_blocks=96,
        max_model_len=256,
        async_scheduling=True,
    )
    got = overlapped.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    got = overlapped.generate(PROMPTS[2:], params[2:], use_tqdm=False)  # overlapped steps
    want = want[2:]
    assert [o.outputs[0].token_ids for o in got] == want
    overlapped.engine.kv.check_integrity()

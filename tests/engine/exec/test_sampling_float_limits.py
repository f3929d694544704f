"""Sampling floats near float32's limits: every value SamplingParams accepts keeps its meaning
in the sampler (finite probabilities that sum to 1, the most likely token always possible);
every other value is refused with a message naming the field."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.core.sampling_params import MIN_TOP_P, SamplingParams
from kvbatch.engine.exec.penalties import TokenHistory
from kvbatch.engine.exec.sampler import Sampler, SamplingTensors, process_logits

VOCAB = 64
NEAR_LIMITS = st.one_of(
    st.sampled_from(
        [1e-46, 1e-300, 5e-324, 1e-45, 1.4e-45, MIN_TOP_P, MIN_TOP_P / 2, 1e-38, 1e-30, 1e-8,
         1e30, 3.4e38, 3.5e38, 1e39, 1e300, 1.7976931348623157e308, 0.0, 1.0, 2.0]
    ),
    st.floats(min_value=0, max_value=1e-35, allow_subnormal=True),
    st.floats(min_value=1e35, allow_infinity=False),
)  # fmt: skip
FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("top_p", 1e-46, "top_p must be at least 1.1754944e-38"),
        ("top_p", 1e-300, "top_p must be at least 1.1754944e-38"),
        ("repetition_penalty", 1e-46, "repetition_penalty must be a number in [1e-30, 1e+30]"),
        ("repetition_penalty", 1e-300, "repetition_penalty must be a number in [1e-30, 1e+30]"),
        ("repetition_penalty", 1e300, "repetition_penalty must be a number in [1e-30, 1e+30]"),
        ("temperature", 1e300, "temperature must be a number in [0, 1e+30]"),
    ],
)
def test_values_float32_cannot_hold_are_refused(field: str, value: float, says: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert says in str(info.value) and repr(value) in str(info.value)


@settings(max_examples=300, deadline=None, database=None)
@given(
    field=st.sampled_from(FIELDS),
    value=NEAR_LIMITS,
    logit_bias=st.sampled_from([None, 1e-300, -1e-46]),
)
def test_accepted_floats_keep_their_meaning_in_the_sampler(field, value, logit_bias) -> None:
    bias = None if logit_bias is None else {3: logit_bias}
    try:
        params = SamplingParams(**{field: value}, logit_bias=bias, seed=1)
    except ValueError as e:
        assert field in str(e)
        return
    logits = torch.linspace(-30, 30, VOCAB)[None, :].repeat(1, 1)  # token VOCAB-1 most likely
    history = [TokenHistory([1, 2, VOCAB - 1], [VOCAB - 1, 5])]
    t = SamplingTensors.from_params([params], [2], VOCAB, "cpu", histories=history)
    if t.processes_logits:
        logits = process_logits(logits.clone(), t)
    assert torch.isfinite(logits).all(), (field, value)
    assert int(Sampler()(logits, t).token_ids) in range(VOCAB)
    if params.greedy:
        return
    probs = Sampler.processed_probs(logits.clone(), t)
    assert torch.isfinite(probs).all(), (field, value)
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-4), (field, value)
    assert float(probs.max()) > 0

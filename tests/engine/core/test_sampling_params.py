from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvbatch.engine.core.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_are_valid() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16 and p.temperature == 1.0 and p.top_p == 1.0
    assert p.top_k == 0 and p.min_p == 0.0 and p.seed is None
    assert p.stop == () and p.stop_token_ids == ()
    assert not p.ignore_eos and p.logprobs is None
    assert not p.greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", True),
        ("max_tokens", 2.0),
        ("max_tokens", "16"),
        ("temperature", -1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "0.5"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("top_p", float("nan")),
        ("top_p", None),
        ("top_k", -2),
        ("top_k", 1.0),
        ("top_k", False),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("min_p", float("nan")),
        ("seed", 1.0),
        ("seed", "1"),
        ("seed", True),
        ("seed", -1),
        ("seed", 2**63),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop", {"a"}),
        ("stop_token_ids", [1, -1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 3),
        ("stop_token_ids", "12"),
        ("ignore_eos", 1),
        ("ignore_eos", None),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", 1.0),
        ("logprobs", True),
    ],
)
def test_invalid_value_raises_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value)  # the message shows what was passed


def test_edge_values_are_accepted() -> None:
    SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=-1, min_p=1, logprobs=0)
    SamplingParams(top_p=1e-9, min_p=0, seed=0, logprobs=MAX_LOGPROBS)
    SamplingParams(seed=2**63 - 1, stop=[], stop_token_ids=[])


def test_numbers_are_normalised() -> None:
    p = SamplingParams(temperature=1, top_p=1, min_p=0, top_k=np.int64(5), seed=np.int32(7))
    assert type(p.temperature) is float and type(p.top_p) is float and type(p.min_p) is float
    assert type(p.top_k) is int and p.top_k == 5
    assert type(p.seed) is int and p.seed == 7
    assert SamplingParams(top_k=-1).top_k == 0  # one spelling of "disabled"


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("a",)).stop == ("a",)
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[2, 0]).stop_token_ids == (2, 0)
    assert SamplingParams(stop_token_ids=(np.int64(3),)).stop_token_ids == (3,)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


def test_normalised_lists_are_copies() -> None:
    stop, ids = ["a"], [1]
    p = SamplingParams(stop=stop, stop_token_ids=ids)
    stop.append("b")
    ids.append(2)
    assert p.stop == ("a",) and p.stop_token_ids == (1,)


def test_greedy() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert SamplingParams(temperature=1e-7).greedy  # would overflow float32 logits / t
    assert not SamplingParams(temperature=0.7, top_k=2).greedy
    assert not SamplingParams(temperature=0.7, top_k=-1).greedy


def test_frozen_and_replace_revalidates() -> None:
    p = SamplingParams(stop="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.0  # type: ignore[misc]
    q = dataclasses.replace(p, temperature=0.0)
    assert q.greedy and q.stop == ("x",)
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=2.0)
    assert hash(p) == hash(SamplingParams(stop=["x"]))

"""scripts/greedy_check.py's verdicts: equal tokens, near ties, real mismatches, drifting logits."""

from __future__ import annotations

import numpy as np
import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def greedy_check():
    return load_script("greedy_check")


def _rows(winners: list[int], vocab: int = 8, margin: float = 1.0) -> np.ndarray:
    """Log-softmax rows where `winners[i]` leads token (winners[i] + 1) % vocab by `margin`."""
    logits = np.zeros((len(winners), vocab))
    for i, w in enumerate(winners):
        logits[i, w] = margin
        logits[i, (w + 1) % vocab] = 0.5 * margin
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


def test_equal_tokens_and_logprobs_match(greedy_check):
    ref = [3, 1, 4]
    rows = _rows(ref)
    got_logprobs = [rows[i, t] + 1e-5 for i, t in enumerate(ref)]
    c = greedy_check.compare(ref, rows, list(ref), got_logprobs)
    assert c.verdict == "match" and c.first_difference is None
    assert c.max_logprob_error == pytest.approx(1e-5)
    assert greedy_check.compare(ref, rows, list(ref), None).max_logprob_error == 0.0


def test_a_flip_between_near_tied_tokens_is_a_near_tie(greedy_check):
    ref = [3, 1, 4]
    rows = _rows(ref, margin=1.0)
    rows[1, 2] = rows[1, 1] - 1e-4  # token 2 is within 1e-4 of transformers' choice
    got = [3, 2, 6]  # kvbatch took the other one; everything after it diverges
    c = greedy_check.compare(ref, rows, got, [rows[0, 3], -1.0, -9.0])
    assert c.verdict == "near tie" and c.first_difference == 1
    assert c.tie_margin == pytest.approx(1e-4)
    assert c.max_logprob_error == pytest.approx(0.0)  # only position 0 is compared


def test_a_flip_with_a_clear_margin_is_a_mismatch(greedy_check):
    ref = [3, 1, 4]
    rows = _rows(ref, margin=1.0)
    c = greedy_check.compare(ref, rows, [3, 5, 4], None)  # 5 trails 1 by 1.0
    assert c.verdict == "mismatch" and c.first_difference == 1
    assert c.tie_margin == pytest.approx(1.0)
    short = greedy_check.compare(ref, rows, [3, 1], None)  # fewer tokens than transformers
    assert short.verdict == "mismatch" and short.first_difference == 2 and short.tie_margin is None


def test_same_tokens_with_drifting_logprobs_fail(greedy_check):
    ref = [3, 1, 4]
    rows = _rows(ref)
    off = greedy_check.LOGPROB_TOL * 5
    got_logprobs = [rows[0, 3], rows[1, 1] - off, rows[2, 4]]
    c = greedy_check.compare(ref, rows, list(ref), got_logprobs)
    assert c.verdict == "logprobs differ" and c.max_logprob_error == pytest.approx(off)

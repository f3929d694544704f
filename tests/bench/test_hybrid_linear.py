"""The hybrid-linear bench's per-GiB figure follows the engine's sizing: a hybrid keeps KV in
a quarter of its layers plus one fixed state slot per sequence."""

from __future__ import annotations

import pytest

from kvbatch.bench.hybrid_linear import TINY_SHAPE, sequences_per_gb


def test_a_long_context_holds_about_four_times_the_sequences():
    per_gb = sequences_per_gb(32768)
    ratio = per_gb["hybrid"] / per_gb["full_attention"]
    layers = TINY_SHAPE["num_hidden_layers"]
    assert ratio == pytest.approx(4.0, rel=0.02)  # the state slot is small beside 32k of KV
    assert ratio < layers / 2  # ... but not free


def test_a_short_context_pays_for_the_state():
    short = sequences_per_gb(16)
    assert short["hybrid"] < short["full_attention"]  # the slot outweighs 16 tokens of KV

"""The context the engine picks before sizing its KV pool, and why."""

from __future__ import annotations

import pytest

from kvbatch.engine.kv.context_len import chosen_context_len


def test_asked_wins_then_the_longest_request_then_the_models_context():
    assert chosen_context_len(512, 100, 4096) == (512, "max_model_len set")
    assert chosen_context_len(0, 100, 4096) == (100, "the job's longest request")
    assert chosen_context_len(0, 9000, 4096) == (4096, "the model's context")
    assert chosen_context_len(0, 0, 4096) == (4096, "the model's context")
    with pytest.raises(ValueError, match="exceeds the model's context of 4096"):
        chosen_context_len(5000, 0, 4096)

"""OpenAI's embeddings `input` shapes, and the errors for the ones it refuses."""

from __future__ import annotations

import pytest

from kvbatch.engine.pooling.inputs import embedding_inputs


def test_each_shape_becomes_a_list_of_prompts():
    assert embedding_inputs("a b") == ["a b"]
    assert embedding_inputs(["a", "b c"]) == ["a", "b c"]
    assert embedding_inputs([5, 6, 7]) == [[5, 6, 7]]
    assert embedding_inputs([[5, 6], [7]]) == [[5, 6], [7]]


@pytest.mark.parametrize(
    "value, message",
    [
        ([], "input is empty"),
        ("", "input 0 is empty"),
        (["a", ""], "input 1 is empty"),
        ([[1], []], "input 1 is empty"),
        (["a", [1]], "not a mix"),
        ([[1, -2]], "token id -2 is negative"),
        ([-1], "input 0: token id -1 is negative"),
        ([5, -1, 3], "token id -1 is negative"),
        ([[1, True]], "token id True"),
        ([1.5], "not a mix"),
        (None, "not NoneType"),
    ],
)
def test_bad_inputs_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        embedding_inputs(value)

"""Reciprocal rank fusion on lists whose answers are worked out by hand."""

from __future__ import annotations

import pytest

from kvbatch.index.fusion import reciprocal_rank_fusion


def test_a_key_in_both_lists_beats_the_top_of_one():
    fused = reciprocal_rank_fusion({"vector": ["a", "b", "c"], "keyword": ["c", "d"]})
    assert [f.key for f in fused] == ["c", "a", "b", "d"]  # b and d tie at 1/62: b came first
    c = fused[0]
    assert c.ranks == {"vector": 3, "keyword": 1}
    assert c.score == pytest.approx(1 / 63 + 1 / 61)
    assert fused[1].score == pytest.approx(1 / 61) and fused[1].ranks == {"vector": 1}


def test_ties_keep_first_appearance_and_repeats_count_once():
    fused = reciprocal_rank_fusion({"vector": ["a", "a", "b"], "keyword": ["b", "a"]}, k=0)
    assert [(f.key, f.score) for f in fused] == [("a", 1 + 1 / 2), ("b", 1 / 3 + 1)]
    fused = reciprocal_rank_fusion({"vector": ["x"], "keyword": ["y"]})
    assert [f.key for f in fused] == ["x", "y"]  # equal scores: the vector list's first


def test_empty_lists_and_a_bad_constant():
    assert reciprocal_rank_fusion({"vector": [], "keyword": []}) == []
    with pytest.raises(ValueError, match="k must be 0 or more"):
        reciprocal_rank_fusion({"vector": ["a"]}, k=-1)

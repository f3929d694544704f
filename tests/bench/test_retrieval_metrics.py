"""recall@k and MRR over a document ranking made from a chunk ranking."""

from __future__ import annotations

import pytest

from kvbatch.bench.retrieval_metrics import document_ranking, rank_of, score


def test_documents_are_ranked_by_their_best_chunk():
    assert document_ranking(["b", "b", "a", "c", "a"]) == ["b", "a", "c"]
    assert rank_of("a", ["b", "a", "c"]) == 2
    assert rank_of("z", ["b", "a"]) is None


def test_recall_at_k_and_mrr():
    s = score([1, 2, 6, None], k=5, depth=50)
    assert s.queries == 4
    assert s.recall_at_k == pytest.approx(2 / 4)
    assert s.mrr == pytest.approx((1 + 1 / 2 + 1 / 6) / 4)
    assert s.to_dict() == {"queries": 4, "recall@5": s.recall_at_k, "mrr": s.mrr, "depth": 50}
    with pytest.raises(ValueError, match="no queries"):
        score([], k=5, depth=50)

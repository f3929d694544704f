"""Retrieval quality with one relevant document per query: recall@k and MRR.

A search returns chunks; several chunks of one document may come back. Documents are ranked
by their first chunk in the list (a document's best chunk), so `document_ranking` turns a chunk
ranking into a document ranking before the metrics are taken. A query whose document is not
among the ranked ones counts 0 for both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def document_ranking(chunk_documents: Iterable[str]) -> list[str]:
    """The distinct document ids of a chunk ranking, in order of their first chunk."""
    seen: dict[str, None] = {}
    for doc in chunk_documents:
        seen.setdefault(doc, None)
    return list(seen)


def rank_of(relevant: str, ranking: Sequence[str]) -> int | None:
    """1-based rank of the relevant document, None when it is not in the ranking."""
    try:
        return ranking.index(relevant) + 1
    except ValueError:
        return None


@dataclass(frozen=True)
class RetrievalScores:
    queries: int
    recall_at_k: float  # share of queries whose document is among the first k documents
    mrr: float  # mean of 1/rank (0 when not ranked)
    k: int
    depth: int  # chunks retrieved per query (documents beyond them are unranked)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "queries": self.queries,
            f"recall@{self.k}": self.recall_at_k,
            "mrr": self.mrr,
            "depth": self.depth,
        }


def score(ranks: Sequence[int | None], k: int, depth: int) -> RetrievalScores:
    """Recall@k and MRR over each query's rank (None: not found within `depth` chunks)."""
    if not ranks:
        raise ValueError("no queries to score")
    hits = sum(1 for r in ranks if r is not None and r <= k)
    reciprocal = sum(1.0 / r for r in ranks if r is not None)
    return RetrievalScores(len(ranks), hits / len(ranks), reciprocal / len(ranks), k, depth)

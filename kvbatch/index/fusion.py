"""Reciprocal rank fusion: one ranking out of several, by rank alone.

A vector search scores by cosine similarity and a keyword search by BM25; the two scales have
nothing in common, so they are not added. Each list instead gives a chunk 1 / (k + rank) and a
chunk's fused score is the sum over the lists that hold it (Cormack, Clarke and Buettcher,
SIGIR 2009; k = 60 as there, and as LanceDB's RRFReranker). A chunk high in both lists
beats one that tops only one, and a chunk found by one list alone still ranks.

    vector:  a b c        keyword: c d
    a: 1/61            = 0.01639
    c: 1/63 + 1/61     = 0.03227   <- first
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

RRF_K = 60


@dataclass
class Fused:
    key: str
    score: float
    ranks: dict[str, int] = field(default_factory=dict)  # list name -> 1-based rank there


def reciprocal_rank_fusion(lists: Mapping[str, Sequence[str]], k: int = RRF_K) -> list[Fused]:
    """The keys of every list, best first, each with its fused score and its rank in each list
    that holds it. Ties keep the order in which the keys first appear (lists in the order
    given, each best first). A key repeated within one list counts at its first rank."""
    if k < 0:
        raise ValueError(f"the fusion constant k must be 0 or more, got {k}")
    fused: dict[str, Fused] = {}
    for name, keys in lists.items():
        for rank, key in enumerate(keys, 1):
            entry = fused.setdefault(key, Fused(key, 0.0))
            if name in entry.ranks:
                continue
            entry.ranks[name] = rank
            entry.score += 1.0 / (k + rank)
    order = {key: i for i, key in enumerate(fused)}
    return sorted(fused.values(), key=lambda f: (-f.score, order[f.key]))

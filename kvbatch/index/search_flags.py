"""The flags of `kvbatch search` beyond URI and QUERY, and where their defaults come from.

`kvbatch search` takes the index either as its URI or as the index spec that writes it: from a
spec it reads `[output] uri, table` and the `[search]` table (`mode`, `rerank`), so a nightly
index and its searches share one file. A flag given on the command line wins over the spec (search_target.py).
Light on purpose: every `kvbatch` command builds this parser, so it imports neither torch nor
pydantic (the GPU check's image has no pydantic).
"""

from __future__ import annotations

import argparse

SEARCH_MODES = ("vector", "keyword", "hybrid")


def add_search_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=SEARCH_MODES,
        default=None,
        help="vector (embeddings), keyword (full-text BM25) or hybrid (both, fused by "
        "reciprocal rank); default hybrid where the table has both",
    )
    p.add_argument(
        "--rerank",
        metavar="MODEL",
        default=None,
        help="a cross-encoder (BERT-family ...ForSequenceClassification, or a yes/no decoder "
        "reranker such as Qwen3-Reranker) that reorders the first --rerank-top hits",
    )
    p.add_argument(
        "--rerank-top",
        type=int,
        default=20,
        metavar="N",
        help="how many hits the reranker scores (default 20)",
    )

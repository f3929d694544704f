"""The flags of `kvbatch search` beyond URI and QUERY, and where their defaults come from.

`kvbatch search` takes the index either as its URI or as the index spec that writes it: from a
spec it reads `[output] uri, table` and the `[search]` table (`mode`, `rerank`), so a nightly
index and its searches share one file. A flag given on the command line wins over the spec.
Light on purpose: `kvbatch --help` imports this, never torch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kvbatch.index.spec import load_spec

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


@dataclass(frozen=True)
class SearchTarget:
    uri: str
    table: str
    mode: str | None
    rerank: str | None


def search_target(args: argparse.Namespace) -> SearchTarget:
    """The table, mode and reranker of a `kvbatch search` call: the flags, then the spec's
    settings when URI names a spec file. Raises SpecError for a spec that does not load."""
    from_spec = args.uri.endswith(".toml") and Path(args.uri).is_file()
    if not from_spec:
        return SearchTarget(args.uri, args.table or "chunks", args.mode, args.rerank)
    spec = load_spec(args.uri)
    return SearchTarget(
        spec.output.uri,
        args.table or spec.output.table,
        args.mode or spec.search.mode,
        args.rerank or spec.search.rerank,
    )

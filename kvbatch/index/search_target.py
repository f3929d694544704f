"""Where `kvbatch search` looks and how: its flags, then the index spec's `[output]` and
`[search]` tables when URI names a spec file (a flag wins)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kvbatch.index.spec import load_spec


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

"""`kvbatch index SPEC.toml` and `kvbatch search URI QUERY -k N`: their flags and what they
print. The pipeline (and torch) is imported only when a command runs, so `kvbatch --help`
stays quick."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvbatch.threads import apply_threads


def add_index_parsers(sub) -> None:
    index = sub.add_parser(
        "index", help="index documents into a LanceDB table, incrementally (docs/INDEXING.md)"
    )
    index.add_argument("spec", help="the index spec (TOML): source, chunking, stages, models")
    index.add_argument(
        "--report", metavar="FILE", help="also write the run's report as JSON to FILE"
    )
    _threads(index)
    search = sub.add_parser("search", help="the chunks of an index nearest to a query")
    search.add_argument("uri", help="the index: a LanceDB folder or s3:// URI (output.uri)")
    search.add_argument("query", help="the text to search for")
    search.add_argument("-k", type=int, default=5, help="how many hits (default 5)")
    search.add_argument("--table", default="chunks", help="the table name (default chunks)")
    _threads(search)


def _threads(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch's operators")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="kvbatch: %(message)s", stream=sys.stderr)
    logging.getLogger("kvbatch").setLevel(logging.INFO)
    try:
        apply_threads(args.threads)
    except ValueError as e:
        print(f"kvbatch {args.command}: {e}", file=sys.stderr)
        return 2
    if args.command == "index":
        return _index(args)
    return _search(args)


def _index(args: argparse.Namespace) -> int:
    from kvbatch.index.pipeline import IndexRunError, run_index
    from kvbatch.index.sources import SourceError
    from kvbatch.index.spec import SpecError, load_spec

    try:
        report = run_index(load_spec(args.spec))
    except (SpecError, SourceError, IndexRunError) as e:
        print(f"kvbatch index: {e}", file=sys.stderr)
        return 2
    for err in report.errors:
        print(f"kvbatch index: error: {err.message} ({err.stage}, {err.code})", file=sys.stderr)
    summary = report.to_dict()
    summary.pop("errors")
    summary["errors"] = len(report.errors)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
    print(json.dumps(summary, indent=2))
    return 0


def _search(args: argparse.Namespace) -> int:
    from kvbatch.index.search import SearchError, search

    try:
        hits = search(args.uri, args.query, args.k, table=args.table)
    except SearchError as e:
        print(f"kvbatch search: {e}", file=sys.stderr)
        return 2
    for i, hit in enumerate(hits, 1):
        text = " ".join(hit.text.split())
        print(f"{i}. {hit.document_id}  score {hit.score:.3f}\n   {text[:300]}")
    return 0

"""`kvbatch bench index-retrieval [--docs N | --tiny] [--rerank MODEL | --no-rerank] [--json PATH]`

Retrieval quality of `kvbatch index` on text nobody here wrote, with known answers, offline:
the Python stdlib's pydoc pages (kvbatch.bench.stdlib_corpus). Each module's one-line summary
is a query; its own page, with the summary removed, is the one relevant document. The corpus
is indexed twice, with plain chunks (the context stage off) and with contextual chunks (each
chunk embedded after the context the generation model wrote for it), and every query is
searched through kvbatch.index.search.search in each mode, with two query sets: the summaries,
and identifiers (a code name only one page holds: bench/identifier_queries.py),: vector, keyword (BM25 over the
chunk and its context), hybrid (both fused by reciprocal rank) and hybrid + rerank (the first
--rerank-top hybrid hits reordered by a reranker; by default SmolLM2-135M-Instruct used as a
zero-shot yes/no reranker, no trained reranker's weights being at hand). A search returns
chunks; documents are ranked by their best chunk, and recall@5 and MRR are taken over that
document ranking (a document not among the DEPTH chunks returned counts 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvbatch.bench.identifier_queries import Query, identifier_queries, summary_queries
from kvbatch.bench.index_run import (
    IndexBenchError,
    Models,
    SpecOptions,
    add_corpus_flags,
    bench_models,
    with_corpus_flags,
    work_folder,
    write_spec,
)
from kvbatch.bench.machine import machine_info
from kvbatch.bench.retrieval_metrics import RetrievalScores, document_ranking, rank_of, score
from kvbatch.bench.stdlib_corpus import StdlibCorpus, build_corpus
from kvbatch.bench.text_table import format_rows
from kvbatch.bench.zero_shot_reranker import ZERO_SHOT_RERANKER, zero_shot_reranker
from kvbatch.engine import LLM
from kvbatch.index.pipeline import run_index
from kvbatch.index.search import search

K = 5
DEPTH = 50  # chunks returned per query


@dataclass(frozen=True)
class RetrievalWorkload:
    docs: int | None  # None: every usable module
    max_chars: int
    chunk_size: int
    context_max_tokens: int

    def summary(self) -> str:
        n = "all usable" if self.docs is None else str(self.docs)
        return (
            f"{n} stdlib pydoc pages cut to {self.max_chars} characters, chunks of "
            f"{self.chunk_size} tokens, contexts of at most {self.context_max_tokens} tokens; "
            f"recall@{K} and MRR over the best chunk of each document among {DEPTH} chunks"
        )


INDEX_RETRIEVAL = RetrievalWorkload(
    docs=None, max_chars=1500, chunk_size=200, context_max_tokens=48
)
TINY_INDEX_RETRIEVAL = RetrievalWorkload(docs=4, max_chars=600, chunk_size=64, context_max_tokens=6)


@dataclass
class ModeResult:
    queries: str  # summaries, identifiers
    mode: str  # vector, keyword, hybrid, hybrid + rerank
    scores: RetrievalScores
    search_seconds: float  # all queries, the models already loaded


@dataclass
class VariantResult:
    name: str  # plain, contextual
    chunks: int
    index_seconds: float
    modes: list[ModeResult]


@dataclass(frozen=True)
class Rerank:
    llm: LLM  # the reranker, loaded once
    top: int  # hybrid hits it reorders


QUERY_SETS = {"summaries": summary_queries, "identifiers": identifier_queries}


def evaluate(
    query_sets: dict[str, list[Query]], uri: str, embedding: LLM, rerank: Rerank | None
) -> list[ModeResult]:
    """Each query searched for in each mode; its document's rank among the documents."""
    modes: list[tuple[str, dict]] = [("vector", {}), ("keyword", {}), ("hybrid", {})]
    if rerank is not None:
        modes.append(("hybrid + rerank", {"reranker": rerank.llm, "rerank_top": rerank.top}))
    results = []
    for set_name, queries in query_sets.items():
        for name, extra in modes:
            mode = name.split(" ")[0]
            start = time.perf_counter()
            ranks = []
            for q in queries:
                hits = search(uri, q.text, DEPTH, mode=mode, llm=embedding, **extra)
                found = document_ranking(h.document_id for h in hits)
                ranks.append(rank_of(q.document_id, found))
            seconds = time.perf_counter() - start
            results.append(ModeResult(set_name, name, score(ranks, K, DEPTH), seconds))
    return results


def run_variant(
    name: str,
    folder: Path,
    work: Path,
    models: Models,
    opts: SpecOptions,
    rerank: Rerank | None,
    query_sets: dict[str, list[Query]],
) -> VariantResult:
    spec = write_spec(work / f"{name}.toml", folder, work / f"{name}.lance", models, opts)
    start = time.perf_counter()
    report = run_index(spec)
    seconds = time.perf_counter() - start
    if report.documents_failed:
        first = report.errors[0].message if report.errors else ""
        raise IndexBenchError(f"{name}: {report.documents_failed} documents failed: {first}")
    embedding = LLM(model=models.embedding)  # loaded once for all queries
    modes = evaluate(query_sets, spec.output.uri, embedding, rerank)
    return VariantResult(name, report.chunks, seconds, modes)


def format_table(
    workload: RetrievalWorkload, corpus: StdlibCorpus, models: Models, results: list[VariantResult],
    machine: dict[str, Any], date: str, reranker: str | None,
) -> str:  # fmt: skip
    lines = [
        f"index-retrieval: {workload.summary()}",
        f"corpus: {corpus.describe()}",
        f"models: {models.names()}; reranker: {reranker or 'none'}; "
        f"{machine['torch_threads']} torch threads, {date}",
        "",
    ]
    rows = [("chunks", "queries", "mode", "n", "chunk rows", f"recall@{K}", "MRR", "index s",
             "search s")]  # fmt: skip
    for r in results:
        for m in r.modes:
            s = m.scores
            rows.append((r.name, m.queries, m.mode, str(s.queries), str(r.chunks),
                         f"{s.recall_at_k:.3f}", f"{s.mrr:.3f}", f"{r.index_seconds:.1f}",
                         f"{m.search_seconds:.1f}"))  # fmt: skip
    return "\n".join(lines + format_rows(rows))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbatch bench index-retrieval",
        description=__doc__.split("\n\n", 1)[1]
        + f"\ndefault: {INDEX_RETRIEVAL.summary()}\n--tiny: {TINY_INDEX_RETRIEVAL.summary()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true", help="4 short pages (tests, a quick check)")
    add_corpus_flags(p, "documents (default: every usable module)")
    p.add_argument("--plain-only", action="store_true", help="skip the contextual index")
    p.add_argument(
        "--rerank",
        metavar="MODEL",
        help="the reranker of the hybrid + rerank rows (a cross-encoder or a yes/no decoder "
        f"reranker); default: {ZERO_SHOT_RERANKER}",
    )
    p.add_argument("--no-rerank", action="store_true", help="leave out the rerank rows")
    p.add_argument(
        "--queries",
        default="summaries,identifiers",
        help="query sets, comma-separated: summaries (each module's one-line summary), "
        "identifiers (a code name only its page holds); default both",
    )
    p.add_argument(
        "--rerank-top", type=int, default=10, metavar="N", help="hybrid hits reranked (10)"
    )
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--work",
        type=Path,
        metavar="DIR",
        help="an empty folder to work in, kept after the run: the corpus, the specs and both "
        "indexes (plain.lance, contextual.lance); default a temporary one",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    w = TINY_INDEX_RETRIEVAL if args.tiny else INDEX_RETRIEVAL
    w = with_corpus_flags(w, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    progress = lambda m: print(m, file=sys.stderr, flush=True)
    set_names = [n.strip() for n in args.queries.split(",") if n.strip()]
    unknown = [n for n in set_names if n not in QUERY_SETS]
    if unknown or not set_names:
        print(f"kvbatch bench: error: --queries: choose from {', '.join(QUERY_SETS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        corpus = build_corpus(limit=w.docs, max_chars=w.max_chars)
        progress(corpus.describe())
        with work_folder(args.work, "kvbatch-retrieval-bench-") as work:
            folder = corpus.write(work / "corpus")
            models = bench_models(work)
            reranker, rerank = None, None
            if not args.no_rerank:
                model = args.rerank or str(zero_shot_reranker(work))
                reranker = args.rerank or ZERO_SHOT_RERANKER
                rerank = Rerank(LLM(model=model), args.rerank_top)
            query_sets = {n: QUERY_SETS[n](corpus) for n in set_names}
            results = []
            variants = [("plain", False)] + ([] if args.plain_only else [("contextual", True)])
            for name, context in variants:
                opts = SpecOptions(w.chunk_size, context, w.context_max_tokens)
                results.append(run_variant(name, folder, work, models, opts, rerank, query_sets))
                for m in results[-1].modes:
                    progress(f"{name}, {m.queries}, {m.mode}: {m.scores.to_dict()}")
    except (IndexBenchError, ValueError) as e:
        print(f"kvbatch bench: error: {e}", file=sys.stderr)
        return 2
    machine = machine_info("cpu")
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    print(format_table(w, corpus, models, results, machine, date, reranker))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "kind": "index-retrieval",
            "workload": asdict(w),
            "corpus": corpus.to_dict(),
            "models": models.names(),
            "reranker": reranker,
            "rerank_top": None if rerank is None else rerank.top,
            "results": [
                {
                    "name": r.name,
                    "query_set": m.queries,
                    "mode": m.mode,
                    "chunks": r.chunks,
                    "index_seconds": r.index_seconds,
                    "search_seconds": m.search_seconds,
                    **m.scores.to_dict(),
                }
                for r in results
                for m in r.modes
            ],  # fmt: skip
            "machine": machine,
            "date": date,
            "command": shlex.join(["kvbatch", "bench", "index-retrieval", *argv]),
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`kvbatch index SPEC.toml` and `kvbatch search URI QUERY -k N`: their flags and what they
print. The pipeline (and torch) is imported only when a command runs, so `kvbatch --help`
stays quick."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys

from kvbatch.index.search_flags import add_search_flags
from kvbatch.metrics_registry import metrics_port, start_metrics_server
from kvbatch.redact import redact_url, redact_urls
from kvbatch.threads import apply_threads


def add_index_parsers(sub) -> None:
    index = sub.add_parser(
        "index", help="index documents into a LanceDB table, incrementally (docs/INDEXING.md)"
    )
    index.add_argument("spec", help="the index spec (TOML): source, chunking, stages, models")
    index.add_argument(
        "--report", metavar="FILE", help="also write the run's report as JSON to FILE"
    )
    index.add_argument(
        "--rebuild",
        action="store_true",
        help="write the table anew from the source, dropping every row it holds (all "
        "sources'): for a damaged table or a new embedding model",
    )
    index.add_argument(
        "--broker",
        help="run the model stages on the workers: redis://, rediss:// or sqs:// "
        "(docs/INDEXING.md, 'On the workers'); without it, on this machine",
    )
    index.add_argument(
        "--generation-queue",
        help="the queue of the generation model's workers (default kvbatch-<model name>)",
    )
    index.add_argument(
        "--embedding-queue",
        help="the queue of the embedding model's workers (default kvbatch-<model name>)",
    )
    index.add_argument(
        "--shard-tokens",
        type=int,
        default=200_000,
        help="prompt tokens per shard of a stage's job (with --broker; default 200000)",
    )
    index.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=0,
        help="serve Prometheus metrics per stage on this port while the run lasts (0: off)",
    )
    index.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port")
    _threads(index)
    search = sub.add_parser("search", help="the chunks of an index that best answer a query")
    search.add_argument(
        "uri",
        help="the index: a LanceDB folder or s3:// URI (output.uri), or the index spec (.toml), "
        "whose [output] and [search] settings are then used",
    )
    search.add_argument("query", help="the text to search for")
    search.add_argument("-k", type=int, default=5, help="how many hits (default 5)")
    search.add_argument("--table", default=None, help="the table name (default chunks)")
    add_search_flags(search)
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
    from kvbatch.index.table import TableError

    metrics = _serve_metrics(args)
    if metrics is False:
        return 1
    try:
        spec = load_spec(args.spec)
        stages = _workers(args, spec) if args.broker else None
        if stages is not None and metrics:
            stages.on_progress = lambda p: metrics.progress(p.stage, p.status)
        report = run_index(spec, stages=stages, metrics=metrics, rebuild=args.rebuild)
    except (SpecError, SourceError, IndexRunError, TableError) as e:
        print(f"kvbatch index: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "kvbatch index: interrupted; the answers so far are kept in the run folder: run "
            "the same command again to go on",
            file=sys.stderr,
        )
        return 130
    for err in report.errors:
        message = _one_line(err.message)
        print(f"kvbatch index: error: {message} ({err.stage}, {err.code})", file=sys.stderr)
    summary = report.to_dict()
    summary.pop("errors")
    summary["errors"] = len(report.errors)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
    print(json.dumps(summary, indent=2))
    return 0


def _serve_metrics(args: argparse.Namespace):
    """The process's index metrics, served on --metrics-port; None when off, False (after
    saying why) when the port cannot be served."""
    if not args.metrics_port:
        return None
    from kvbatch.index.metrics import process_metrics

    metrics = process_metrics()
    try:
        start_metrics_server(args.metrics_port, args.metrics_host)
    except OSError as e:
        print(
            f"kvbatch index: cannot serve metrics on {args.metrics_host}:{args.metrics_port}"
            f" ({e.strerror}): pick another --metrics-port",
            file=sys.stderr,
        )
        return False
    return metrics


def _workers(args: argparse.Namespace, spec):
    """The stages on the workers of `--broker`: the broker reached and each queue made (SQS)
    before any work, so an unreachable broker leaves no job nobody runs."""
    from kvbatch.broker.app import celery_app
    from kvbatch.broker.settings import BrokerError, broker_url
    from kvbatch.broker.sqs import ensure_queue
    from kvbatch.index.distributed import DistributedStages
    from kvbatch.index.pipeline import IndexRunError

    if args.shard_tokens < 1:
        raise IndexRunError(f"--shard-tokens must be positive, got {args.shard_tokens}")
    try:
        app = celery_app(broker_url(args.broker))
    except BrokerError as e:
        raise IndexRunError(str(e)) from e
    queues = {}
    if args.generation_queue and spec.models.generation:
        queues[spec.models.generation] = args.generation_queue
    if args.embedding_queue:
        queues[spec.models.embedding] = args.embedding_queue
    stages = DistributedStages(app, queues, shard_tokens=args.shard_tokens)
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
        for model in {spec.models.generation, spec.models.embedding} - {None}:
            ensure_queue(app, stages.queue_for(model))
    except Exception as e:  # kombu raises the transport's own errors (redis, botocore, ...)
        url = str(app.conf.broker_url)
        raise IndexRunError(
            f"cannot reach the broker {redact_url(url)} or make its queues: "
            f"{redact_urls(str(e), url)}"
        ) from e
    return stages


def _search(args: argparse.Namespace) -> int:
    from kvbatch.index.search import SearchError, search
    from kvbatch.index.search_target import search_target
    from kvbatch.index.spec import SpecError

    try:
        target = search_target(args)
        hits = search(
            target.uri,
            args.query,
            args.k,
            table=target.table,
            mode=target.mode,
            rerank=target.rerank,
            rerank_top=args.rerank_top,
        )
    except (SearchError, SpecError) as e:
        print(f"kvbatch search: {e}", file=sys.stderr)
        return 2
    for i, hit in enumerate(hits, 1):
        text = " ".join(hit.text.split())
        found = ", ".join(f"{name} #{rank}" for name, rank in hit.ranks.items())
        print(f"{i}. {hit.document_id}  score {hit.score:.4f}  ({found})\n   {text[:300]}")
    return 0


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _one_line(message: str) -> str:
    """A document id may hold a newline or a terminal escape (a file name can): shown escaped,
    one error per line."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], message)

"""`kvbatch bench index-cpu [--docs N | --tiny] [--threads N] [--json PATH]`

The indexing job end to end (read, parse, chunk, context, embed, LanceDB write) on real
documents (the Python stdlib's pydoc pages, kvbatch.bench.stdlib_corpus), by `kvbatch index`
(kvbatch.index.pipeline.run_index) and by the pipeline a user would write today
(kvbatch.bench.index_peer: transformers `generate` in static batches of 8 (--user-batch) +
sentence-transformers `encode` + LanceDB `add`), one after the other in one process on the
same torch threads, each into a fresh table and each timed whole (model loads included: both
load the same two models). `--long-docs` takes documents of about 1,000 to 2,500 tokens, a
dozen chunks each, where decoding a document's chunks together is most of the job.

Both tables are then compared row by row: the same chunk ids and texts, and, for every chunk
whose embedded text (context and chunk) is the same on both sides, vectors with cosine
>= 0.999 (MIN_COSINE). A missing row or one vector off fails the benchmark (exit status 1). Contexts
are greedy on both sides; the table says on how many chunks they are equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbatch.bench.index_peer import UserPipeline, UserRun
from kvbatch.bench.index_run import (
    IndexBenchError,
    IndexRows,
    Models,
    SpecOptions,
    add_corpus_flags,
    bench_models,
    read_rows,
    with_corpus_flags,
    work_folder,
    write_spec,
)
from kvbatch.bench.machine import machine_info
from kvbatch.bench.stdlib_corpus import build_corpus
from kvbatch.bench.text_table import format_rows
from kvbatch.index.pipeline import run_index
from kvbatch.index.report import IndexReport

MIN_COSINE = 0.999
"""Per chunk with the same embedded text: the same MiniLM weights and tokenizer on both sides
(float32); lower is a wrong vector, not rounding."""


@dataclass(frozen=True)
class IndexWorkload:
    docs: int
    max_chars: int  # each page cut to this many characters
    chunk_size: int
    context_max_tokens: int
    min_chars: int = 0  # shorter pages are left out
    user_batch: int = 8  # the hand-written pipeline's `generate` batch

    def summary(self) -> str:
        pages = f"pages of {self.min_chars} to" if self.min_chars else "pages cut to"
        return (
            f"{self.docs} stdlib pydoc {pages} {self.max_chars} characters, chunks of "
            f"{self.chunk_size} tokens, contexts of at most {self.context_max_tokens} tokens; "
            f"the user's generate in batches of {self.user_batch}"
        )


INDEX_CPU = IndexWorkload(docs=200, max_chars=1500, chunk_size=200, context_max_tokens=48)
TINY_INDEX_CPU = IndexWorkload(docs=2, max_chars=400, chunk_size=64, context_max_tokens=4)
# documents of about 1,000 to 2,500 generation tokens (pydoc text: ~3.6 characters a token),
# about a dozen chunks of 180 embedding tokens each, 48-token contexts
LONG_DOCS = IndexWorkload(
    docs=6, max_chars=9000, chunk_size=180, context_max_tokens=48, min_chars=4000
)


@dataclass
class Agreement:
    kvbatch_rows: int
    user_rows: int
    same_texts: bool  # the same chunk ids with the same texts on both sides
    same_context: int  # chunks whose contexts are equal (so are their embedded texts)
    min_cosine: float | None  # over the chunks with the same embedded text
    worst_chunk: str | None

    @property
    def agrees(self) -> bool:
        return (
            self.kvbatch_rows == self.user_rows
            and self.same_texts
            and self.same_context > 0
            and self.min_cosine is not None
            and self.min_cosine >= MIN_COSINE
        )


def compare(kvbatch: IndexRows, user: IndexRows) -> Agreement:
    """Rows, texts and, where both embedded the same text, vectors."""
    same_texts = kvbatch.text == user.text
    shared = [c for c in kvbatch.text if c in user.text and kvbatch.context[c] == user.context[c]]
    worst, low = None, None
    for c in shared:
        a, b = kvbatch.vector[c], user.vector[c]
        cos = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        if low is None or cos < low:
            worst, low = c, cos
    return Agreement(len(kvbatch), len(user), same_texts, len(shared), low, worst)


@dataclass
class IndexBenchReport:
    workload: IndexWorkload
    corpus: dict[str, Any]
    models: str
    kvbatch_seconds: float
    user_seconds: float
    kvbatch: IndexReport
    user: UserRun
    agreement: Agreement
    machine: dict[str, Any]
    date: str
    command: str = ""
    # the process's CPU seconds for each side (all threads): on shared cores wall time also
    # counts the waits for a core, which differ between two sides run one after the other
    kvbatch_cpu_seconds: float = float("nan")
    user_cpu_seconds: float = float("nan")
    chunks: int = field(init=False)

    def __post_init__(self) -> None:
        self.chunks = self.agreement.kvbatch_rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "index-bench",
            "workload": asdict(self.workload),
            "corpus": self.corpus,
            "models": self.models,
            "documents": self.workload.docs,
            "chunks": self.chunks,
            "kvbatch": {
                "seconds": self.kvbatch_seconds,
                "cpu_seconds": self.kvbatch_cpu_seconds,
                "report": self.kvbatch.to_dict(),
            },
            "user": {
                "seconds": self.user_seconds,
                "cpu_seconds": self.user_cpu_seconds,
                **asdict(self.user),
            },
            "ratio": self.user_seconds / self.kvbatch_seconds,
            "cpu_ratio": self.user_cpu_seconds / self.kvbatch_cpu_seconds,
            "agreement": dict(asdict(self.agreement), agrees=self.agreement.agrees),
            "min_cosine_required": MIN_COSINE,
            "machine": self.machine,
            "date": self.date,
            "command": self.command,
        }

    def format_table(self) -> str:
        m, a, p = self.machine, self.agreement, self.kvbatch.prefill
        docs, n = self.kvbatch.documents_parsed, self.chunks
        lines = [
            f"index ({self.machine['device']}): {self.workload.summary()}",
            f"corpus: {self.corpus['describe']}",
            f"models: {self.models}; {m['device']} ({m['device_name']}), "
            f"{m['torch_threads']} torch threads, {self.date}",
            "",
        ]
        rows = [("pipeline", "seconds", "documents/s", "chunks/s", "prefill tokens", "ratio")]
        rows.append(
            ("kvbatch index", f"{self.kvbatch_seconds:.1f}", f"{docs / self.kvbatch_seconds:.2f}",
             f"{n / self.kvbatch_seconds:.2f}", f"{p.computed}", "1.00")
        )  # fmt: skip
        rows.append(
            (f"user: generate (batch {self.workload.user_batch}) + encode + add",
             f"{self.user_seconds:.1f}",
             f"{docs / self.user_seconds:.2f}", f"{n / self.user_seconds:.2f}",
             f"{self.user.prompt_tokens}", f"{self.user_seconds / self.kvbatch_seconds:.2f}")
        )  # fmt: skip
        lines += format_rows(rows)
        ratio = p.computed / p.ideal if p.ideal else float("nan")
        lines += [
            "",
            f"prefill tokens (kvbatch): computed {p.computed}, ideal {p.ideal} "
            f"(computed/ideal {ratio:.3f}), no sharing {p.no_sharing}; the user's pipeline "
            f"prefills every prompt in full: {self.user.prompt_tokens}",
            "kvbatch stages (s): " + _stages(self.kvbatch.stage_seconds),
            "user stages (s): " + _stages(self.user.seconds),
            "ratio = user seconds / kvbatch seconds (> 1: kvbatch is faster); each side timed "
            "whole, model loads included",
            f"CPU seconds (the process, all threads): kvbatch {self.kvbatch_cpu_seconds:.1f}, "
            f"user {self.user_cpu_seconds:.1f}, ratio "
            f"{self.user_cpu_seconds / self.kvbatch_cpu_seconds:.2f}",
            f"rows: kvbatch {a.kvbatch_rows}, user {a.user_rows}; same chunk texts: "
            f"{'yes' if a.same_texts else 'NO'}; same context on {a.same_context} of "
            f"{a.kvbatch_rows} chunks; min cosine there "
            + (f"{a.min_cosine:.6f}" if a.min_cosine is not None else "-"),
            f"rows and vectors agree (cosine >= {MIN_COSINE}): "
            + ("yes" if a.agrees else "NO: the benchmark failed"),
        ]
        return "\n".join(lines)


def _stages(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())


def run_index_bench(
    workload: IndexWorkload,
    work: Path,
    threads: int | None = None,
    device: str = "cpu",
    command: str = "",
    progress=lambda _m: None,
) -> IndexBenchReport:
    if threads is not None:
        if threads < 1:
            raise IndexBenchError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    corpus = build_corpus(
        limit=workload.docs, max_chars=workload.max_chars, min_chars=workload.min_chars
    )
    if len(corpus.documents) < workload.docs:
        raise IndexBenchError(
            f"--docs {workload.docs}: the stdlib gives {len(corpus.documents)} documents here"
        )
    folder = corpus.write(work / "corpus")
    models: Models = bench_models(work)
    opts = SpecOptions(workload.chunk_size, True, workload.context_max_tokens, {"device": device})
    spec = write_spec(work / "index.toml", folder, work / "kvbatch.lance", models, opts)
    progress(f"kvbatch index: {corpus.describe()}")
    start, cpu = time.perf_counter(), time.process_time()
    report = run_index(spec)
    kvbatch_seconds = time.perf_counter() - start
    kvbatch_cpu = time.process_time() - cpu
    progress(f"kvbatch index: {kvbatch_seconds:.1f} s; the user's pipeline next")
    user = UserPipeline(
        generation_model=models.generation,
        embedding_model=models.embedding,
        chunk_size=workload.chunk_size,
        context_max_tokens=workload.context_max_tokens,
        prompt=spec.stages.context.prompt,
        device=device,
        source=spec.source.owner,
        generate_batch_size=workload.user_batch,
    )
    start, cpu = time.perf_counter(), time.process_time()
    user_run = user.run(folder, str(work / "user.lance"))
    user_seconds = time.perf_counter() - start
    user_cpu = time.process_time() - cpu
    progress(f"user pipeline: {user_seconds:.1f} s")
    agreement = compare(
        read_rows(spec.output.uri, spec.output.table), read_rows(str(work / "user.lance"))
    )
    return IndexBenchReport(
        workload=workload,
        corpus=dict(corpus.to_dict(), describe=corpus.describe()),
        models=models.names(),
        kvbatch_seconds=kvbatch_seconds,
        user_seconds=user_seconds,
        kvbatch=report,
        user=user_run,
        agreement=agreement,
        machine=machine_info(device),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        command=command,
        kvbatch_cpu_seconds=kvbatch_cpu,
        user_cpu_seconds=user_cpu,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbatch bench index-cpu",
        description=__doc__.split("\n\n", 1)[1]
        + f"\ndefault: {INDEX_CPU.summary()}\n--tiny: {TINY_INDEX_CPU.summary()}"
        + f"\n--long-docs: {LONG_DOCS.summary()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true", help="2 short pages (tests, a quick check)")
    p.add_argument(
        "--long-docs",
        action="store_true",
        help="6 pages of 1,000 to 2,500 tokens, a dozen chunks each",
    )
    p.add_argument("--min-chars", type=int, help="leave out pages shorter than this")
    p.add_argument("--user-batch", type=int, help="the user's generate batch size (8)")
    add_corpus_flags(p, f"documents (default {INDEX_CPU.docs})")
    p.add_argument("--threads", type=int, help="torch threads for both pipelines")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: both pipelines")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    p.add_argument(
        "--work",
        type=Path,
        metavar="DIR",
        help="an empty folder to work in, kept after the run: the corpus, the spec and both "
        "tables (kvbatch.lance, user.lance); default a temporary one",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status 0, 1 when the two tables disagree, 2 for bad arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    w = TINY_INDEX_CPU if args.tiny else LONG_DOCS if args.long_docs else INDEX_CPU
    w = with_corpus_flags(w, args)
    if args.min_chars is not None:
        w = dataclasses.replace(w, min_chars=args.min_chars)
    if args.user_batch is not None:
        w = dataclasses.replace(w, user_batch=args.user_batch)
    if w.docs < 1:
        print(f"kvbatch bench: error: --docs must be >= 1, got {w.docs}", file=sys.stderr)
        return 2
    progress = lambda m: print(m, file=sys.stderr, flush=True)
    try:
        with work_folder(args.work, "kvbatch-index-bench-") as work:
            report = run_index_bench(
                w, work, args.threads, args.device,
                shlex.join(["kvbatch", "bench", "index-cpu", *argv]), progress,
            )  # fmt: skip
    except (IndexBenchError, ValueError) as e:
        print(f"kvbatch bench: error: {e}", file=sys.stderr)
        return 2
    print(report.format_table())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return 0 if report.agreement.agrees else 1


if __name__ == "__main__":
    sys.exit(main())

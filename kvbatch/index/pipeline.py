"""`kvbatch index SPEC.toml` on one machine: plan, generate, embed, merge.

    source --read, hash (unchanged: skipped)--> parse --> chunk
      --generation job (context, questions, summary; the document a shared prefix)-->
      --embeddings job (chunk with its context)--> rows
      --one merge on chunk_id--> LanceDB table; the rows as Parquet + manifest in the run folder

Before any document is read, kvbatch.index.preflight checks what can be checked (the source,
the models, the table and whether it takes this spec's rows). The run sees only the rows of
its own source (spec source.name): other sources sharing the table are left as they are.
A document too long for the generation model's context is given to its prompts as windows
(kvbatch.index.windows). The generation and the embedding model load in turn (one in memory
at a time). Each model
stage is a kvbatch job in the run's folder, run with --resume: a killed run started again
finds the same plan (nothing was merged), so the same run folder, and answers only what the
killed one had not.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from kvbatch.engine import LLM
from kvbatch.index.chunking import Chunker
from kvbatch.index.embed import embedding_lines, read_vectors
from kvbatch.index.embed_budget import EmbeddingBudget
from kvbatch.index.errors import IndexRunError
from kvbatch.index.generate import Generated, generation_lines, read_generated
from kvbatch.index.identity import RowIdentity
from kvbatch.index.metrics import IndexMetrics
from kvbatch.index.plan import Plan, WorkDocument, make_plan
from kvbatch.index.prefill import prefill_tokens
from kvbatch.index.preflight import preflight
from kvbatch.index.report import ErrorRecord, IndexReport, PrefillTokens
from kvbatch.index.rows import build_rows, write_run_files
from kvbatch.index.spec import IndexSpec
from kvbatch.index.stage_jobs import StageAnswers, run_stage, write_lines
from kvbatch.index.table import document_state, open_table, write_rows
from kvbatch.index.windows import DocumentWindows, WindowBudget, WindowError, document_windows
from kvbatch.jobs.local.output_lock import OutputBusy
from kvbatch.jobs.local.run import JobError, JobInterrupted
from kvbatch.jobs.storage import Storage, open_storage

log = logging.getLogger("kvbatch.index")

LLMFactory = Callable[[str], Any]  # model (as the spec names it) -> a kvbatch.engine.LLM


__all__ = ["IndexRunError", "LocalStages", "StageOutcome", "StageRunner", "run_index"]


def engine_settings(spec: IndexSpec, model: str) -> dict:
    """spec.engine for `model`: [engine] max_model_len sets the generation model's context
    (the one long documents are windowed for); the embedding model's context is its own."""
    if model == spec.models.embedding and model != spec.models.generation:
        return {k: v for k, v in spec.engine.items() if k != "max_model_len"}
    return dict(spec.engine)


def default_llm_factory(spec: IndexSpec) -> LLMFactory:
    """LLM(model, **engine_settings), with the spec's revision for that model."""
    revisions = {
        spec.models.embedding: spec.models.embedding_revision,
        spec.models.generation: spec.models.generation_revision,
    }

    def make(model: str):
        extra = {"revision": revisions[model]} if revisions.get(model) else {}
        return LLM(model=model, **{**engine_settings(spec, model), **extra})

    return make


@dataclass
class StageOutcome:
    """What a model stage's job gave back, and (generation) its prefill accounting."""

    answers: StageAnswers
    prefill: PrefillTokens | None = None


class StageRunner(Protocol):
    """Runs one model stage's job, whose lines are already in <run folder>/<stage>/input.jsonl,
    to the end (or resumes it) and reads its answers: on this machine (LocalStages) or on the
    workers (kvbatch.index.distributed.DistributedStages). The run folder is local or on S3."""

    def run(self, stage: str, run_folder: Storage, model: str, role: str) -> StageOutcome: ...


@dataclass
class LocalStages:
    """The stages on this machine: each model loads in turn (one in memory at a time)."""

    factory: LLMFactory
    spec: IndexSpec

    def run(self, stage: str, run_folder: Storage, model: str, role: str) -> StageOutcome:
        folder = run_folder.join(stage)
        llm = _load(self.factory, model, role)
        try:
            answers = _run_stage(folder, model, llm, engine_settings(self.spec, model), stage)
            prefill = None
            if stage == "generate":
                prefill = prefill_tokens(folder.join("input.jsonl"), llm.engine, answers)
        finally:
            _release(llm)
        return StageOutcome(answers, prefill)


def run_index(
    spec: IndexSpec,
    *,
    llm_factory: LLMFactory | None = None,
    stages: StageRunner | None = None,
    metrics: IndexMetrics | None = None,
    rebuild: bool = False,
) -> IndexReport:
    """Bring the table up to date with the source; see the module docstring. `stages` runs
    the model stages (default: on this machine, with `llm_factory`'s models); `metrics`
    counts each stage's documents, chunks and seconds (kvbatch.index.metrics). `rebuild`
    writes the table anew from the source (a damaged table, another embedding model): every
    document is redone and the old table, all sources' rows, is dropped at the write."""
    report = IndexReport(source=spec.source.owner, rebuilt=rebuild)
    runner = stages or LocalStages(llm_factory or default_llm_factory(spec), spec)
    observe = _Observer(report, metrics)
    with _timed(report, "plan"):
        checked = preflight(spec, rebuild)
        identity = checked.identity
        report.embedding_revision = identity.embedding_revision
        report.generation_revision = identity.generation_revision
        budget = checked.embedding_budget
        size = budget.chunk_size(spec.chunking.size)
        chunker = Chunker.for_tokenizer(
            checked.embedding_tokenizer, size, min(spec.chunking.overlap, size // 2)
        )
        state = document_state(checked.table, spec.source.owner)
        plan = make_plan(spec.source, state, identity, chunker, checked.listed)
    _count_plan(report, plan)
    observe.stage("plan", plan.work)
    if plan.empty:
        log.info("index: %d documents, all up to date: nothing to write", plan.seen)
        observe.finished()
        return report
    report.run_id = plan.run_id(identity)
    folder = open_storage(spec.output.runs).join(report.run_id)
    docs = plan.work
    generated = Generated()
    if spec.stages.generates and docs:
        with _timed(report, "generate"):
            windows, errors = _windows(docs, checked.windows, report)
            report.errors += errors
            docs = _without(docs, errors)
            generated, errors = _generate(spec, docs, windows, folder, runner, report)
        observe.stage("generate", docs)
        report.errors += errors
        docs = _without(docs, errors)
    vectors: dict[str, np.ndarray] = {}
    if spec.stages.embed and docs:
        with _timed(report, "embed"):
            vectors, errors = _embed(spec, docs, generated, folder, runner, budget)
        observe.stage("embed", docs)
        report.errors += errors
        docs = _without(docs, errors)
    with _timed(report, "write"):
        _write(spec, checked.db, plan, docs, generated, vectors, identity, folder, report)
    observe.stage("write", docs, chunks=report.chunks)
    report.documents_failed = len({e.document_id for e in report.errors})
    observe.finished()
    return report


def _windows(
    docs: list[WorkDocument], budget: WindowBudget, report: IndexReport
) -> tuple[dict[str, DocumentWindows], list[ErrorRecord]]:
    """What each document's prompts hold of it: the document, or windows of a long one."""
    windows: dict[str, DocumentWindows] = {}
    errors = []
    for doc in docs:
        try:
            windows[doc.id] = document_windows(doc.text, doc.chunks, budget)
        except WindowError as e:
            errors.append(ErrorRecord(doc.id, "context", "too_long", f"{doc.id}: {e}"))
    report.documents_windowed = sum(1 for w in windows.values() if w.windowed)
    if report.documents_windowed:
        log.info(
            "generate: %d documents longer than the generation model's context (%d tokens): "
            "given as windows",
            report.documents_windowed,
            budget.max_model_len,
        )
    return windows, errors


@dataclass
class _Observer:
    """Hands each finished stage's counts and seconds to the metrics, when there are any."""

    report: IndexReport
    metrics: IndexMetrics | None

    def stage(self, stage: str, docs: list[WorkDocument], chunks: int | None = None) -> None:
        if self.metrics is not None:
            n = _chunks(docs) if chunks is None else chunks
            self.metrics.stage(stage, len(docs), n, self.report.stage_seconds.get(stage, 0.0))

    def finished(self) -> None:
        if self.metrics is not None:
            self.metrics.finished(self.report)


def _count_plan(report: IndexReport, plan: Plan) -> None:
    report.documents_seen = plan.seen
    report.documents_parsed = len(plan.work)
    report.documents_skipped = plan.skipped
    report.documents_deleted = len(plan.deleted)
    report.errors = list(plan.errors)
    report.documents_failed = len(plan.errors)
    log.info(
        "index: %d documents: %d to do (%d chunks), %d unchanged, %d deleted, %d failed",
        plan.seen,
        len(plan.work),
        sum(len(d.chunks) for d in plan.work),
        plan.skipped,
        len(plan.deleted),
        len(plan.errors),
    )


def _generate(
    spec: IndexSpec,
    docs,
    windows: dict[str, DocumentWindows],
    folder: Storage,
    runner: StageRunner,
    report: IndexReport,
):
    model = spec.models.generation
    lines = generation_lines(docs, spec.stages, _name(model), windows)
    n = write_lines(folder.join("generate", "input.jsonl"), lines)
    log.info("generate: %d documents, %d chunks, %d requests", len(docs), _chunks(docs), n)
    outcome = runner.run("generate", folder, model, "generation")
    answers = outcome.answers
    report.prefill = outcome.prefill or PrefillTokens()
    p = report.prefill
    log.info(
        "generate: prefill tokens computed %d, ideal %d, without sharing %d",
        p.computed,
        p.ideal,
        p.no_sharing,
    )
    generated = read_generated(docs, spec.stages, answers)
    return generated, generated.errors


def _embed(
    spec: IndexSpec,
    docs,
    generated: Generated,
    folder: Storage,
    runner: StageRunner,
    budget: EmbeddingBudget,
):
    model = spec.models.embedding
    lines = embedding_lines(docs, generated, _name(model), budget)
    n = write_lines(folder.join("embed", "input.jsonl"), lines)
    log.info("embed: %d documents, %d chunks", len(docs), n)
    answers = runner.run("embed", folder, model, "embedding").answers
    log.info("embed: %d prompt tokens", answers.prompt_tokens)
    return read_vectors(docs, answers)


def _load(factory: LLMFactory, model: str, role: str):
    try:
        return factory(model)
    except (OSError, ValueError) as e:
        raise IndexRunError(f"models.{role}: cannot load {model}: {e}") from e
    except TypeError as e:  # a keyword of [engine] that kvbatch.engine.LLM does not take
        raise IndexRunError(f"engine: {e}: see kvbatch.engine.LLM's keywords") from e


def _run_stage(folder: Storage, model: str, llm, engine: dict, stage: str):
    try:
        return run_stage(folder, model, llm, engine)
    except JobInterrupted:  # Ctrl-C or a kill: the stage's answers so far are kept
        raise KeyboardInterrupt from None
    except JobError as e:  # another run holds the stage's output, an unwritable folder, ...
        if isinstance(e.__cause__, OutputBusy):
            raise IndexRunError(
                f"{stage}: another index run is doing this same work (it holds {folder.uri}): "
                "wait for it to finish; running the spec again then finds its rows written"
            ) from e
        raise IndexRunError(f"{stage}: {e}") from e


def _write(
    spec: IndexSpec,
    db,
    plan: Plan,
    docs: list[WorkDocument],
    generated: Generated,
    vectors: dict[str, np.ndarray],
    identity: RowIdentity,
    folder: Storage,
    report: IndexReport,
) -> None:
    table = None if report.rebuilt else open_table(db, spec.output.table)
    dimension = _dimension(spec, table, vectors)
    if spec.stages.embed and dimension is None:  # nothing embedded and no table yet
        return
    rows = build_rows(
        docs, generated, vectors, dimension, identity, report.run_id, spec.source.owner
    )
    replaced = [d.id for d in docs] + plan.deleted
    if table is None and rows.num_rows == 0:
        return
    manifest = {
        "run_id": report.run_id,
        "table": {"uri": spec.output.uri, "name": spec.output.table},
        "source": spec.source.owner,
        "rebuild": report.rebuilt,
        "identity": identity.__dict__,
        "documents": {d.id: d.hash for d in docs},
        "deleted": plan.deleted,
        "errors": [e.__dict__ for e in report.errors],
        "rows": rows.num_rows,
    }
    write_run_files(folder, rows, {**manifest, "status": "merging"})
    merged = write_rows(
        db, spec.output.table, rows, replaced, source=spec.source.owner, rebuild=report.rebuilt
    )
    report.table_version = merged.version
    report.chunks_deleted = merged.deleted
    report.chunks = rows.num_rows
    report.wrote = True
    write_run_files(folder, rows, {**manifest, "status": "merged", "version": report.table_version})
    for stage in ("generate", "embed"):  # their inputs repeat each document per chunk
        folder.join(stage).delete_tree()
    log.info(
        "write: %d rows for %d documents, %d documents deleted: table version %d",
        rows.num_rows,
        len(docs),
        len(plan.deleted),
        report.table_version,
    )


def _dimension(spec: IndexSpec, table, vectors: dict[str, np.ndarray]) -> int | None:
    if not spec.stages.embed:
        return None
    new = len(next(iter(vectors.values()))) if vectors else None
    old = None
    if table is not None and "embedding" in table.schema.names:
        old = table.schema.field("embedding").type.list_size
    if new is not None and old is not None and new != old:
        raise IndexRunError(
            f"the embedding model gives {new}-dimensional vectors but the table "
            f"{spec.output.table} holds {old}-dimensional ones: name a new table (output.table), "
            "or write this one anew with `kvbatch index SPEC --rebuild`"
        )
    return new or old


def _without(docs: list[WorkDocument], errors: list[ErrorRecord]) -> list[WorkDocument]:
    failed = {e.document_id for e in errors}
    return [d for d in docs if d.id not in failed]


def _chunks(docs: list[WorkDocument]) -> int:
    return sum(len(d.chunks) for d in docs)


def _name(model: str) -> str:
    return Path(model.rstrip("/")).name


def _release(llm) -> None:
    """Drop the model before the next loads: on one machine they take turns."""
    engine = getattr(llm, "engine", None)
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def _timed(report: IndexReport, stage: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        report.stage_seconds[stage] = report.stage_seconds.get(stage, 0.0) + (
            time.perf_counter() - start
        )

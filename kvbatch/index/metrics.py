"""Prometheus metrics of index runs, per stage, on the process's metrics registry (the one
metrics_registry.py serves on --metrics-port): `kvbatch index --metrics-port N` and
`kvbatch index-worker --metrics-port N` expose them while they run.

Counters, so a long-lived index worker adds run after run:
    kvbatch_index_documents_total{stage}       documents a stage took (plan: parsed ones)
    kvbatch_index_chunks_total{stage}          their chunks (write: rows written)
    kvbatch_index_stage_seconds_total{stage}   time spent in the stage
    kvbatch_index_prefill_tokens_total{kind}   computed, ideal, no_sharing (generation)
    kvbatch_index_errors_total{stage}          error records (a document each)
    kvbatch_index_runs_total{outcome}          merged, up_to_date
and, while a stage runs on the workers (`--broker`), a gauge of its job's progress:
    kvbatch_index_stage_progress{stage, what}  shards_done, shards_total, requests_done,
                                               requests_total, output_tokens
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvbatch.index.report import IndexReport
from kvbatch.metrics_registry import REGISTRY


class IndexMetrics:
    """The index counters on `registry` (default: the process's, which the workers serve)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else REGISTRY
        self.documents = Counter(
            "kvbatch_index_documents", "Documents an index stage took", ["stage"], registry=r
        )
        self.chunks = Counter(
            "kvbatch_index_chunks", "Chunks an index stage took", ["stage"], registry=r
        )
        self.seconds = Counter(
            "kvbatch_index_stage_seconds", "Seconds spent in an index stage", ["stage"], registry=r
        )
        self.prefill = Counter(
            "kvbatch_index_prefill_tokens",
            "Prompt tokens of the generation stage: computed by the engine, the ideal (each "
            "document once), and without prefix sharing",
            ["kind"],
            registry=r,
        )
        self.errors = Counter(
            "kvbatch_index_errors", "Error records (one per document)", ["stage"], registry=r
        )
        self.runs = Counter("kvbatch_index_runs", "Index runs by outcome", ["outcome"], registry=r)
        self.job_progress = Gauge(
            "kvbatch_index_stage_progress",
            "A stage job's progress on the workers (kvbatch status's counts)",
            ["stage", "what"],
            registry=r,
        )

    def stage(self, stage: str, documents: int, chunks: int, seconds: float) -> None:
        self.documents.labels(stage=stage).inc(documents)
        self.chunks.labels(stage=stage).inc(chunks)
        self.seconds.labels(stage=stage).inc(seconds)

    def progress(self, stage: str, status: dict) -> None:
        """A distributed stage job's job_status (kvbatch.jobs.distributed.finalize)."""
        done = status["completed"] + status["failed"] + status.get("running_finished", 0)
        for what, value in (("shards_done", status["shards_done"]),
                            ("shards_total", status["shards_total"]),
                            ("requests_done", done), ("requests_total", status["requests"]),
                            ("output_tokens", status["output_tokens"])):  # fmt: skip
            self.job_progress.labels(stage=stage, what=what).set(value)

    def finished(self, report: IndexReport) -> None:
        """The run's prefill accounting, error records and outcome (after its last stage)."""
        p = report.prefill
        for kind, value in (("computed", p.computed), ("ideal", p.ideal),
                            ("no_sharing", p.no_sharing)):  # fmt: skip
            self.prefill.labels(kind=kind).inc(value)
        for err in report.errors:
            self.errors.labels(stage=err.stage).inc()
        self.runs.labels(outcome="merged" if report.wrote else "up_to_date").inc()


_PROCESS: IndexMetrics | None = None


def process_metrics() -> IndexMetrics:
    """The process's index metrics on the served registry, made once."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = IndexMetrics()
    return _PROCESS

"""Prometheus metrics of one worker process (prometheus_client), served on --metrics-port.

The engine keeps running totals (engine.stats(): tokens, preemptions, prefix cache lookups);
`observe_engine` turns them into Prometheus counters by adding the growth since its last call,
and sets the gauges (requests running and waiting, KV cache usage, tokens per step). The shard
task (worker/tasks.py) calls it between engine steps (at most once a second) and after each
shard, and `shard_finished` once per shard: shards by status, lines by status per job.

Latency histograms (worker/latency_metrics.py) are observed per finished request through
`request_finished`; `kvbatch_model_info{model_name}` names the model the worker serves, and
the latency histograms carry the same label. The per-job line counter's series are dropped
once a job has had no shard finish here for `job_ttl` seconds (KVBATCH_METRICS_JOB_TTL,
default an hour), so a worker that lives through thousands of jobs keeps a bounded /metrics.

Every metric lives on its own CollectorRegistry (not prometheus_client's global one), so tests
build a fresh `WorkerMetrics` and read it with `generate_latest(m.registry)`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvbatch.jobs.distributed.cancelled import CANCELLED
from kvbatch.metrics_registry import REGISTRY
from kvbatch.metrics_registry import start_metrics_server as serve_registry
from kvbatch.worker.latency_metrics import RequestLatency

log = logging.getLogger("kvbatch.worker")

DEFAULT_PORT = 9400
DEFAULT_JOB_TTL = 3600.0
SHARD_STATUSES = ("done", "duplicate", "failed", "poisoned", "cancelled")
LINE_STATUSES = ("completed", "failed", "cancelled")

# engine.stats() field -> the counter that follows it
_ENGINE_COUNTERS = {
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "computed_tokens": "computed_tokens",
    "num_preemptions": "preemptions",
    "prefix_queries": "prefix_queries",
    "prefix_hits": "prefix_hits",
    "num_steps": "steps",
    "num_finished": "requests_finished",
    "spec_draft_tokens": "spec_draft_tokens",
    "spec_accepted_tokens": "spec_accepted_tokens",
}


class WorkerMetrics:
    """The metric objects of a worker, on `registry` (a new one by default)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        job_ttl: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.job_ttl = job_ttl_from_env() if job_ttl is None else job_ttl
        self.clock = clock
        self._job_seen: dict[str, float] = {}  # job_id -> when a shard of it last finished
        self.model_name = ""
        r = self.registry
        self.latency = RequestLatency(r)
        self.model_info = Gauge(
            "kvbatch_model_info",
            "The model this worker serves (value 1)",
            ["model_name"],
            registry=r,
        )
        self.spec_acceptance_by_position = Gauge(
            "kvbatch_spec_decode_acceptance_rate_by_position",
            "Fraction of speculative draft tokens accepted at each position of the draft",
            ["position"],
            registry=r,
        )
        self.requests_running = Gauge(
            "kvbatch_requests_running", "Requests the engine scheduler is running", registry=r
        )
        self.requests_waiting = Gauge(
            "kvbatch_requests_waiting", "Requests waiting in the engine scheduler", registry=r
        )
        self.kv_cache_usage = Gauge(
            "kvbatch_kv_cache_usage_ratio",
            "Fraction of KV cache blocks referenced by some sequence",
            registry=r,
        )
        self.kv_cache_blocks = Gauge(
            "kvbatch_kv_cache_blocks", "KV cache blocks of the engine", registry=r
        )
        self.tokens_per_step = Gauge(
            "kvbatch_tokens_per_step",
            "Tokens run through the model per engine step, since the previous observation",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvbatch_prompt_tokens", "Prompt tokens of requests admitted", registry=r
        )
        self.generation_tokens = Counter(
            "kvbatch_generation_tokens", "Tokens generated", registry=r
        )
        self.computed_tokens = Counter(
            "kvbatch_computed_tokens",
            "Tokens run through the model (prefill, decode and recompute)",
            registry=r,
        )
        self.preemptions = Counter(
            "kvbatch_preemptions", "Requests preempted for want of KV cache blocks", registry=r
        )
        self.prefix_queries = Counter(
            "kvbatch_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "kvbatch_prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r
        )
        self.steps = Counter("kvbatch_engine_steps", "Engine steps", registry=r)
        self.requests_finished = Counter(
            "kvbatch_requests_finished", "Requests the engine finished", registry=r
        )
        self.spec_draft_tokens = Counter(
            "kvbatch_spec_decode_draft_tokens",
            "Speculative draft tokens proposed (0 when speculative decoding is off)",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "kvbatch_spec_decode_accepted_tokens",
            "Speculative draft tokens accepted by the target model",
            registry=r,
        )
        self.shards = Counter("kvbatch_shards", "Shards handled, by status", ["status"], registry=r)
        for status in SHARD_STATUSES:
            self.shards.labels(status=status)  # exported at 0 from the start
        self.lines = Counter(
            "kvbatch_lines",
            "Output lines written, by job and status",
            ["job_id", "status"],
            registry=r,
        )
        self.messages_dropped = Counter(
            "kvbatch_messages_dropped",
            "Shard messages dropped unrun: they do not match their job's manifest (tampered "
            "or stale), by reason",
            ["reason"],
            registry=r,
        )
        self.messages_deferred = Counter(
            "kvbatch_messages_deferred",
            "Deliveries of a shard that was running elsewhere, sent again later",
            registry=r,
        )
        self.shard_seconds = Histogram(
            "kvbatch_shard_seconds",
            "Seconds a shard ran on the engine",
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200),
            registry=r,
        )
        self._lock = threading.Lock()
        # A weak reference, not id(): a new engine can reuse a collected engine's id.
        self._engine_ref: weakref.ref | None = None
        self._last: dict[str, int] = {}

    def observe_engine(self, engine) -> None:
        """Read `engine` (an engine.LLMEngine, or an engine.LLM): set the gauges and add to
        each counter what the engine's total grew by since the previous call. A total that went
        down (another engine, or a restarted one) counts from zero again."""
        engine = getattr(engine, "engine", engine)  # engine.LLM wraps the LLMEngine
        stats = engine.stats()
        scheduler = engine.scheduler
        with self._lock:
            if self._engine_ref is None or self._engine_ref() is not engine:
                self._engine_ref, self._last = weakref.ref(engine), {}
            for field, name in _ENGINE_COUNTERS.items():
                value = int(getattr(stats, field))
                last = self._last.get(field, 0)
                delta = value - last if value >= last else value
                if delta:
                    getattr(self, name).inc(delta)
                self._last[field] = value
            steps = self._last["num_steps"] - self._last.get("steps_at_gauge", 0)
            computed = self._last["computed_tokens"] - self._last.get("computed_at_gauge", 0)
            if steps > 0:
                self.tokens_per_step.set(computed / steps)
                self._last["steps_at_gauge"] = self._last["num_steps"]
                self._last["computed_at_gauge"] = self._last["computed_tokens"]
            self.requests_running.set(len(scheduler.running))
            self.requests_waiting.set(len(scheduler.waiting))
            self.kv_cache_usage.set(stats.kv_usage)
            self.kv_cache_blocks.set(stats.num_kv_blocks)
            for position, rate in enumerate(stats.spec_acceptance_by_position):
                self.spec_acceptance_by_position.labels(position=str(position)).set(rate)

    def set_model(self, model_name: str) -> None:
        """Name the model the latency histograms and kvbatch_model_info are labelled with."""
        if model_name == self.model_name:
            return
        if self.model_name:
            self.model_info.remove(self.model_name)
        self.model_name = model_name
        self.model_info.labels(model_name=model_name).set(1)

    def request_finished(self, out) -> None:
        """Observe one finished engine output in the latency histograms."""
        self.latency.observe(out, self.model_name)

    def shard_finished(
        self,
        job_id: str,
        status: str,
        lines_by_status: Mapping[str, int] | None = None,
        seconds: float | None = None,
    ) -> None:
        """Count one shard (status: done, duplicate, failed, poisoned, cancelled) and the lines
        it wrote for its job (completed, failed, cancelled)."""
        if status not in SHARD_STATUSES:
            raise ValueError(f"shard status {status!r}: expected one of {SHARD_STATUSES}")
        self.shards.labels(status=status).inc()
        for line_status, n in (lines_by_status or {}).items():
            if n:
                self.lines.labels(job_id=job_id, status=line_status).inc(n)
        if seconds is not None:
            self.shard_seconds.observe(seconds)
        with self._lock:
            now = self.clock()
            self._job_seen[job_id] = now
            self._forget_jobs_idle_since(now - self.job_ttl)

    def _forget_jobs_idle_since(self, cutoff: float) -> None:
        """Drop the line series of jobs whose last shard finished before `cutoff`."""
        for job_id in [j for j, seen in self._job_seen.items() if seen < cutoff]:
            del self._job_seen[job_id]
            for line_status in LINE_STATUSES:
                try:
                    self.lines.remove(job_id, line_status)
                except KeyError:  # this status never counted a line of the job
                    pass


def job_ttl_from_env() -> float:
    """Seconds a finished job's series stay on /metrics (KVBATCH_METRICS_JOB_TTL)."""
    raw = os.environ.get("KVBATCH_METRICS_JOB_TTL")
    if raw is None:
        return DEFAULT_JOB_TTL
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"KVBATCH_METRICS_JOB_TTL={raw!r}: expected seconds") from None
    if value < 0:
        raise ValueError(f"KVBATCH_METRICS_JOB_TTL={raw!r}: must be 0 or more")
    return value


def lines_by_status(records) -> dict[str, int]:
    """{completed, failed, cancelled: count} of a shard's [(index, line)] (a cancelled line
    counts as cancelled only, not also as failed)."""
    counts = dict.fromkeys(LINE_STATUSES, 0)
    for _, line in records:
        error = line.get("error")
        if not error:
            counts["completed"] += 1
        elif error.get("code") == CANCELLED:
            counts["cancelled"] += 1
        else:
            counts["failed"] += 1
    return counts


class StepObserver:
    """`should_stop` for run_shard that also observes the engine, at most once every `every`
    seconds, before asking the wrapped check (the job's cancel check)."""

    def __init__(
        self,
        engine,
        should_stop: Callable[[], bool] | None = None,
        *,
        metrics: WorkerMetrics | None = None,
        every: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine, self.should_stop, self.every, self.clock = engine, should_stop, every, clock
        self.metrics = metrics
        self._next = 0.0

    def __call__(self) -> bool:
        now = self.clock()
        if now >= self._next:
            self._next = now + self.every
            safe_observe(self.engine, self.metrics)
        return bool(self.should_stop()) if self.should_stop is not None else False


# -- the process's metrics ------------------------------------------------------------------

METRICS = WorkerMetrics(REGISTRY)  # the process's registry: one port serves every metric


def observe_engine(engine, metrics: WorkerMetrics | None = None) -> None:
    (metrics or METRICS).observe_engine(engine)


def safe_observe(engine, metrics: WorkerMetrics | None = None) -> None:
    """observe_engine that never raises: metrics must not fail a shard."""
    try:
        observe_engine(engine, metrics)
    except Exception:
        log.debug("observing the engine failed", exc_info=True)


def shard_finished(
    job_id: str,
    status: str,
    lines_by_status: Mapping[str, int] | None = None,
    seconds: float | None = None,
    metrics: WorkerMetrics | None = None,
) -> None:
    (metrics or METRICS).shard_finished(job_id, status, lines_by_status, seconds)


def set_model(model_name: str, metrics: WorkerMetrics | None = None) -> None:
    (metrics or METRICS).set_model(model_name)


def request_finished(out, metrics: WorkerMetrics | None = None) -> None:
    """Observe one finished engine output; never raises (metrics must not fail a shard)."""
    try:
        (metrics or METRICS).request_finished(out)
    except Exception:
        log.debug("observing a request failed", exc_info=True)


def message_dropped(reason: str, metrics: WorkerMetrics | None = None) -> None:
    """Count a shard message dropped unrun (reason: a short fixed word, e.g. "mismatch")."""
    (metrics or METRICS).messages_dropped.labels(reason=reason).inc()


def message_deferred(metrics: WorkerMetrics | None = None) -> None:
    (metrics or METRICS).messages_deferred.inc()


class RunMetrics:
    """`kvbatch run --metrics-port`'s RunMonitor: the worker's engine metrics and latency
    histograms for a local run (observing the engine at most once every `every` seconds)."""

    def __init__(
        self, model_name: str, metrics: WorkerMetrics | None = None, every: float = 1.0
    ) -> None:
        self.metrics = metrics or METRICS
        self.metrics.set_model(model_name)
        self.every = every
        self._next = 0.0

    def step(self, engine) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every
            safe_observe(engine, self.metrics)

    def output(self, out) -> None:
        request_finished(out, self.metrics)


def start_metrics_server(port: int, addr: str = "0.0.0.0", metrics: WorkerMetrics | None = None):
    """Serve `metrics`' registry (default: the process's) on `port` (0: nothing)."""
    return serve_registry(port, addr, (metrics or METRICS).registry)

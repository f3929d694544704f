"""Per-request latency histograms, named and bucketed like vLLM's, labelled by model.

    kvbatch_time_to_first_token_seconds     arrival -> first output token   (vllm:time_to_first_token_seconds)
    kvbatch_time_per_output_token_seconds   mean gap after the first token  (vllm:time_per_output_token_seconds)
    kvbatch_e2e_request_latency_seconds     arrival -> last output token    (vllm:e2e_request_latency_seconds)
    kvbatch_request_queue_time_seconds      arrival -> first scheduled      (vllm:request_queue_time_seconds)

A request's clock starts when the shard hands it to the engine (kvbatch.jobs.grouping's
window), so time to first token includes its wait in the engine's queue, which the queue-time
histogram shows apart (until the scheduler first admits it into the running batch). Embedding
requests generate no token and are not observed here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read these too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class RequestLatency:
    """The four histograms, observed once per finished request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.time_to_first_token = Histogram(
            "kvbatch_time_to_first_token_seconds",
            "Seconds from a request's arrival in the engine to its first output token",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "kvbatch_time_per_output_token_seconds",
            "Mean seconds between a request's output tokens after the first",
            ["model_name"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "kvbatch_request_queue_time_seconds",
            "Seconds from a request's arrival in the engine to its first admission to a step",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "kvbatch_e2e_request_latency_seconds",
            "Seconds from a request's arrival in the engine to its last output token",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=r,
        )

    def observe(self, out, model_name: str) -> None:
        """Observe one finished engine output (a RequestOutput; others are skipped)."""
        m = getattr(out, "metrics", None)
        if m is None:
            return
        if m.time_to_first_token is not None:
            self.time_to_first_token.labels(model_name=model_name).observe(m.time_to_first_token)
        if m.time_per_output_token is not None:
            self.time_per_output_token.labels(model_name=model_name).observe(
                m.time_per_output_token
            )
        if getattr(m, "queue_time", None) is not None:
            self.queue_time.labels(model_name=model_name).observe(m.queue_time)
        if m.finished_time is not None:
            self.e2e_latency.labels(model_name=model_name).observe(m.finished_time - m.arrival_time)

"""Latency histograms, the model label, per-position speculative acceptance and the
forgetting of finished jobs' series, on a real engine and a real registry."""

from __future__ import annotations

import pytest

from kvbatch.worker.metrics import WorkerMetrics, job_ttl_from_env
from tests.worker.test_metrics import _samples


@pytest.fixture(scope="module")
def spec_llm(tiny_models):
    """A tiny model drafting for itself: every draft is accepted, at every position."""
    from kvbatch.engine import LLM

    path = str(tiny_models("llama-gqa"))
    return LLM(
        model=path, device="cpu", num_kv_blocks=32, max_model_len=128, speculative=f"draft:{path}"
    )


def test_latency_histograms_and_model_label(spec_llm):
    from kvbatch.engine import SamplingParams

    m = WorkerMetrics()
    m.set_model("tiny")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = spec_llm.generate([list(range(3, 40)), [9, 10, 11]], params, use_tqdm=False)
    for out in outs:
        m.request_finished(out)
    m.observe_engine(spec_llm)
    s = _samples(m)
    label = (("model_name", "tiny"),)
    assert s[("kvbatch_model_info", label)] == 1
    for name in (
        "kvbatch_time_to_first_token_seconds",
        "kvbatch_time_per_output_token_seconds",
        "kvbatch_e2e_request_latency_seconds",
    ):
        assert s[(name + "_count", label)] == 2, name
        assert s[(name + "_sum", label)] > 0, name
    ttft = s[("kvbatch_time_to_first_token_seconds_sum", label)]
    assert s[("kvbatch_e2e_request_latency_seconds_sum", label)] >= ttft

    stats = spec_llm.stats()
    assert stats.spec_acceptance_by_position  # the requests did speculate
    for position, rate in enumerate(stats.spec_acceptance_by_position):
        key = ("kvbatch_spec_decode_acceptance_rate_by_position", (("position", str(position)),))
        assert s[key] == pytest.approx(rate) and 0 <= rate <= 1

    m.set_model("other")  # a job of another model name: one info series at a time
    s = _samples(m)
    assert ("kvbatch_model_info", label) not in s
    assert s[("kvbatch_model_info", (("model_name", "other"),))] == 1


def test_finished_jobs_series_are_dropped_after_the_ttl():
    now = [0.0]
    m = WorkerMetrics(job_ttl=60, clock=lambda: now[0])
    m.shard_finished("job-a", "done", {"completed": 3, "failed": 1})
    now[0] = 30
    m.shard_finished("job-b", "done", {"completed": 2})
    series = lambda: {
        dict(k[1]).get("job_id") for k in _samples(m) if k[0] == "kvbatch_lines_total"
    }  # noqa: E731
    assert series() == {"job-a", "job-b"}
    now[0] = 61  # job-a idle for 61 s, job-b for 31 s: only job-a goes
    m.shard_finished("job-b", "done", {"completed": 1})
    assert series() == {"job-b"}
    s = _samples(m)
    assert s[("kvbatch_lines_total", (("job_id", "job-b"), ("status", "completed")))] == 3
    assert s[("kvbatch_shards_total", (("status", "done"),))] == 3  # totals stay


def test_job_ttl_from_the_environment(monkeypatch):
    monkeypatch.delenv("KVBATCH_METRICS_JOB_TTL", raising=False)
    assert job_ttl_from_env() == 3600
    monkeypatch.setenv("KVBATCH_METRICS_JOB_TTL", "120")
    assert job_ttl_from_env() == 120
    monkeypatch.setenv("KVBATCH_METRICS_JOB_TTL", "soon")
    with pytest.raises(ValueError, match="KVBATCH_METRICS_JOB_TTL='soon'"):
        job_ttl_from_env()

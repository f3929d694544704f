"""Latency histograms, the model label, per-position speculative acceptance and the
forgetting of finished jobs' series, on a real engine and a real registry."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

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
        "kvbatch_request_queue_time_seconds",
    ):
        assert s[(name + "_count", label)] == 2, name
        assert s[(name + "_sum", label)] >= 0, name
    ttft = s[("kvbatch_time_to_first_token_seconds_sum", label)]
    assert ttft > 0 and s[("kvbatch_request_queue_time_seconds_sum", label)] <= ttft
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


def test_kvbatch_run_feeds_the_metrics(tmp_path, tiny_chat_model):
    from kvbatch.engine import LLM
    from kvbatch.jobs.local.run import RunOptions, run_job
    from kvbatch.worker.metrics import RunMetrics

    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": f"count {i}", "max_tokens": 4, "temperature": 0},
        }
        for i in range(3)
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    m = WorkerMetrics()
    opts = RunOptions(
        input=str(source), model=str(tiny_chat_model), monitor=RunMetrics("tiny", m, every=0)
    )
    llm = LLM(model=str(tiny_chat_model), device="cpu", max_num_seqs=4)
    assert run_job(opts, llm=llm).completed == 3
    s = _samples(m)
    assert s[("kvbatch_e2e_request_latency_seconds_count", (("model_name", "tiny"),))] == 3
    assert s[("kvbatch_generation_tokens_total", ())] >= 3 * 4 - 4  # observed between steps


def test_kvbatch_run_metrics_port_on_a_busy_port_says_so(tmp_path, tiny_chat_model):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    source = tmp_path / "in.jsonl"
    source.write_text("")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "kvbatch.cli", "run", str(source), "--model",
             str(tiny_chat_model), "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        busy.close()
    assert run.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in run.stderr

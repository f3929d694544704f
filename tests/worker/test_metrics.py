"""The worker's Prometheus metrics (worker/metrics.py): engine counters on a real tiny engine,
shard and line counts from the shard task, the /metrics endpoint, and the Grafana dashboard's
expressions against the names actually exported. Each test reads its own CollectorRegistry."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvbatch.worker import metrics as metrics_mod
from kvbatch.worker.metrics import WorkerMetrics, lines_by_status, start_metrics_server
from tests.redis_server import redis_server  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvbatch.json"


def _samples(m: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} parsed back from the exported text."""
    text = generate_latest(m.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(scope="module")
def tiny_llm(tiny_chat_model):
    from kvbatch.engine import LLM

    return LLM(model=str(tiny_chat_model), device="cpu", max_num_seqs=4)


def test_observe_engine_exports_the_engine_totals(tiny_llm):
    from kvbatch.engine import SamplingParams

    m = WorkerMetrics()
    m.observe_engine(tiny_llm)  # a baseline: the engine may have run before (module fixture)
    before = tiny_llm.engine.stats()
    shared = "You are a librarian. Answer in one short sentence. " * 8
    prompts = [shared + f"Where is book {i}?" for i in range(3)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tiny_llm.generate(prompts[:1], params, use_tqdm=False)
    tiny_llm.generate(prompts[1:], params, use_tqdm=False)  # the shared prefix is cached now
    m.observe_engine(tiny_llm.engine)
    m.observe_engine(tiny_llm.engine)  # a second call adds nothing
    after = tiny_llm.engine.stats()

    got = _samples(m)

    def value(name):
        return got[(name, ())]

    assert after.generation_tokens - before.generation_tokens == 15
    assert value("kvbatch_generation_tokens_total") == after.generation_tokens
    assert value("kvbatch_prompt_tokens_total") == after.prompt_tokens
    assert value("kvbatch_computed_tokens_total") == after.computed_tokens
    assert value("kvbatch_prefix_cache_queries_total") == after.prefix_queries
    assert value("kvbatch_prefix_cache_hits_total") == after.prefix_hits
    assert after.prefix_hits > before.prefix_hits  # the later prompts hit the cached prefix
    assert value("kvbatch_preemptions_total") == after.num_preemptions
    assert value("kvbatch_engine_steps_total") == after.num_steps
    assert value("kvbatch_requests_finished_total") == after.num_finished
    assert value("kvbatch_requests_running") == 0 and value("kvbatch_requests_waiting") == 0
    assert value("kvbatch_kv_cache_usage_ratio") == pytest.approx(after.kv_usage)
    assert value("kvbatch_kv_cache_blocks") == after.num_kv_blocks
    steps = after.num_steps - before.num_steps
    computed = after.computed_tokens - before.computed_tokens
    if before.num_steps == 0:  # else the gauge's first interval began before `before`
        assert value("kvbatch_tokens_per_step") == pytest.approx(computed / steps)
    assert value("kvbatch_tokens_per_step") > 0
    assert value("kvbatch_spec_decode_draft_tokens_total") == after.spec_draft_tokens == 0
    assert value("kvbatch_spec_decode_accepted_tokens_total") == after.spec_accepted_tokens

    # only the growth is added: more generation adds exactly the new tokens
    tiny_llm.generate(prompts[:1], params, use_tqdm=False)
    m.observe_engine(tiny_llm)
    assert _samples(m)[("kvbatch_generation_tokens_total", ())] == after.generation_tokens + 5


class _FakeScheduler:
    def __init__(self):
        self.running, self.waiting = [1, 2], [3]


class _FakeEngine:
    def __init__(self, **totals):
        from kvbatch.engine.core.outputs import EngineStats

        self.scheduler = _FakeScheduler()
        base = dict(
            num_requests=0, num_finished=0, num_steps=0, prompt_tokens=0, computed_tokens=0,
            generation_tokens=0, num_preemptions=0, prefix_queries=0, prefix_hits=0,
            kv_usage=0.25, num_kv_blocks=64, block_size=16,
        )  # fmt: skip
        self._stats = EngineStats(**{**base, **totals})

    def stats(self):
        return self._stats


def test_a_new_engine_counts_from_zero_and_gauges_follow_the_scheduler():
    m = WorkerMetrics()
    m.observe_engine(_FakeEngine(generation_tokens=10, num_preemptions=2, num_steps=4,
                                 computed_tokens=40))  # fmt: skip
    m.observe_engine(_FakeEngine(generation_tokens=3, num_steps=1, computed_tokens=2))
    got = _samples(m)
    assert got[("kvbatch_generation_tokens_total", ())] == 13
    assert got[("kvbatch_preemptions_total", ())] == 2
    assert got[("kvbatch_requests_running", ())] == 2
    assert got[("kvbatch_requests_waiting", ())] == 1
    assert got[("kvbatch_kv_cache_usage_ratio", ())] == 0.25
    assert got[("kvbatch_tokens_per_step", ())] == 2.0


def test_step_observer_throttles_and_asks_the_cancel_check():
    m = WorkerMetrics()
    calls = []
    now = [0.0]
    engine = _FakeEngine(generation_tokens=1)
    orig = m.observe_engine
    m.observe_engine = lambda e: (calls.append(e), orig(e))  # type: ignore[method-assign]
    stop = [False]
    hook = metrics_mod.StepObserver(
        engine, lambda: stop[0], metrics=m, every=1.0, clock=lambda: now[0]
    )
    assert hook() is False and len(calls) == 1
    now[0] = 0.5
    assert hook() is False and len(calls) == 1  # within the second: not observed again
    now[0] = 1.2
    stop[0] = True
    assert hook() is True and len(calls) == 2
    broken = metrics_mod.StepObserver(object(), None, metrics=m)  # stats() missing
    assert broken() is False  # metrics never fail a shard


def test_shards_and_lines_by_status():
    m = WorkerMetrics()
    got = _samples(m)
    for status in metrics_mod.SHARD_STATUSES:  # exported at 0 before any shard
        assert got[("kvbatch_shards_total", (("status", status),))] == 0
    records = [
        (0, {"response": {"status_code": 200}, "error": None}),
        (1, {"response": None, "error": {"code": "invalid_prompt"}}),
        (2, {"response": None, "error": {"code": "batch_cancelled"}}),
        (3, {"response": {"status_code": 200}, "error": None}),
    ]
    counts = lines_by_status(records)
    assert counts == {"completed": 2, "failed": 1, "cancelled": 1}
    m.shard_finished("job-a", "done", counts, seconds=3.0)
    m.shard_finished("job-a", "done", {"completed": 1})
    m.shard_finished("job-b", "duplicate")
    with pytest.raises(ValueError):
        m.shard_finished("job-b", "exploded")
    got = _samples(m)
    assert got[("kvbatch_shards_total", (("status", "done"),))] == 2
    assert got[("kvbatch_shards_total", (("status", "duplicate"),))] == 1
    assert got[("kvbatch_lines_total", (("job_id", "job-a"), ("status", "completed")))] == 3
    assert got[("kvbatch_lines_total", (("job_id", "job-a"), ("status", "failed")))] == 1
    assert got[("kvbatch_lines_total", (("job_id", "job-a"), ("status", "cancelled")))] == 1
    assert not any(k[0] == "kvbatch_lines_total" and ("job_id", "job-b") in k[1] for k in got)
    assert got[("kvbatch_shard_seconds_count", ())] == 1


def test_handle_shard_counts_the_shard_and_its_lines(
    tmp_path, tiny_llm, tiny_chat_model, monkeypatch
):
    from kvbatch.jobs.distributed.submit import prepare_job
    from kvbatch.worker import tasks
    from kvbatch.worker.app import TASK_NAME, make_app
    from tests.worker.test_distributed import _chat, _write_input

    m = WorkerMetrics()
    monkeypatch.setattr(metrics_mod, "METRICS", m)
    # with --max-model-len the worker keeps its engine for every job (kvbatch.jobs.job_context)
    model = tasks.WorkerModel(str(tiny_chat_model), {"max_model_len": 1})
    model._llm = tiny_llm  # loaded once for the module
    task = make_app("redis://127.0.0.1:1/0").tasks[TASK_NAME]
    task.use_model(model)
    input_path = _write_input(tmp_path / "input.jsonl", [_chat(i, system=False) for i in range(3)])
    output = tmp_path / "out"
    job = prepare_job(str(input_path), str(output), str(tiny_chat_model))
    before = tiny_llm.engine.stats().generation_tokens
    summaries = [tasks.handle_shard(task, str(output), msg.to_dict()) for msg in job.messages]
    again = tasks.handle_shard(task, str(output), job.messages[0].to_dict())  # a redelivery
    assert all(s.get("written") for s in summaries) and again.get("duplicate")
    got = _samples(m)
    n = len(job.messages)
    assert got[("kvbatch_shards_total", (("status", "done"),))] == n
    assert got[("kvbatch_shards_total", (("status", "duplicate"),))] == 1
    assert got[("kvbatch_lines_total", (("job_id", job.job_id), ("status", "completed")))] == 3
    assert got[("kvbatch_shard_seconds_count", ())] == n
    generated = tiny_llm.engine.stats().generation_tokens
    assert generated > before
    assert got[("kvbatch_generation_tokens_total", ())] == generated  # observed after the shard


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_endpoint_answers(monkeypatch):
    assert start_metrics_server(0) is None  # 0: off
    m = WorkerMetrics()
    m.shard_finished("job-x", "done", {"completed": 2})
    port = _free_port()
    server, thread = start_metrics_server(port, addr="127.0.0.1", metrics=m)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
            body = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'kvbatch_shards_total{status="done"} 1.0' in body
    assert 'kvbatch_lines_total{job_id="job-x",status="completed"} 2.0' in body
    assert "kvbatch_kv_cache_usage_ratio" in body


def test_worker_metrics_port_option():
    from kvbatch.worker.cli import add_worker_args

    p = argparse.ArgumentParser()
    add_worker_args(p)
    assert p.parse_args(["--model", "m"]).metrics_port == 9400
    assert p.parse_args(["--model", "m", "--metrics-port", "0"]).metrics_port == 0
    assert p.parse_args(["--model", "m"]).metrics_host == "0.0.0.0"  # scraped from outside


def _listening(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    found = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        address, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":  # LISTEN
            found.add(address)
    return found


@pytest.mark.slow
def test_worker_binds_metrics_to_the_host_given(tmp_path, redis_server, tiny_chat_model):  # noqa: F811
    port = _free_port()
    log = tmp_path / "worker.log"
    args = ["worker", "--model", str(tiny_chat_model), "--broker", redis_server.url,
            "--device", "cpu", "--metrics-port", str(port), "--metrics-host", "127.0.0.1"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbatch.cli", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert _listening(port) == {"0100007F"}  # 127.0.0.1 only, not 0.0.0.0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert "kvbatch_messages_dropped" in r.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_dashboard_uses_only_exported_metrics():
    m = WorkerMetrics()
    m.shard_finished("job", "done", {"completed": 1}, seconds=1.0)  # labelled series exist
    exported = {name for name, _ in _samples(m)}
    dashboard = json.loads(DASHBOARD.read_text())
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\bkvbatch_[a-z0-9_]+", target["expr"]))
    assert used, "the dashboard shows no kvbatch metric"
    assert used <= exported, sorted(used - exported)
    for needed in ("kvbatch_requests_running", "kvbatch_requests_waiting",
                   "kvbatch_preemptions_total", "kvbatch_lines_total", "kvbatch_shards_total",
                   "kvbatch_spec_decode_draft_tokens_total"):  # fmt: skip
        assert needed in used, needed

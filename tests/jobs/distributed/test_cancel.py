"""Cancelling a distributed job, in process: the marker, a running shard that stops between
engine steps, pending shards skipped, and the finalize of a cancelled job."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvbatch.jobs.distributed.cancel import CancelCheck, cancel_job
from kvbatch.jobs.distributed.finalize import (
    cancel_requested,
    job_status,
    read_manifest,
    record_attempt,
    try_finalize,
    write_shard_result,
)
from kvbatch.jobs.distributed.shards import job_dir, read_shard, run_shard
from kvbatch.jobs.grouping import feed_in_order
from tests.jobs.distributed.test_submit import BLOCK_SIZE, MAX_MODEL_LEN, prepare, rag_lines
from tests.jobs.local.test_run import read_jsonl

MiB = 1024 * 1024


def read_bytes(target) -> bytes:
    with target.open_read() as f:
        return f.read()


@pytest.fixture
def slow_llm(tiny_chat_model: Path):
    """Two sequences at a time, so requests finish in waves over many steps."""
    from kvbatch.engine import LLM

    return LLM(
        model=str(tiny_chat_model),
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=2,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=64 * MiB,
    )


def stop_after(calls: int):
    """A should_stop that turns true on its `calls`-th call."""
    seen = []

    def should_stop() -> bool:
        seen.append(1)
        return len(seen) >= calls

    return should_stop


def _run(llm, job, msg, **kw):
    m = read_manifest(job)
    return run_shard(
        llm, msg, model_name=m["model_name"], batch_id=m["batch_id"], created=m["created_at"], **kw
    )


def test_feed_in_order_stops_between_steps_and_aborts(slow_llm):
    from kvbatch.engine import SamplingParams

    engine = slow_llm.engine
    params = SamplingParams(max_tokens=8, temperature=0)
    feed = ((str(i), [1, 2, 3, 4 + i], params) for i in range(6))
    outs = list(feed_in_order(engine, feed, window=4, should_stop=stop_after(10)))
    assert 0 < len(outs) < 6
    assert not engine.has_unfinished()  # the requests inside were aborted
    # The engine is usable afterwards.
    again = list(feed_in_order(engine, [("x", [5, 6, 7], params)], window=2))
    assert [o.request_id for o in again] == ["x"]


def test_run_shard_stop_keeps_finished_lines(tmp_path, slow_llm, tiny_chat_model):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=100_000)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    msg = sub.messages[0]
    requests = read_shard(msg)
    records = _run(slow_llm, job, msg, should_stop=stop_after(12))
    assert sorted(i for i, _ in records) == sorted(r.index for r in requests)
    codes = Counter((r["error"] or {}).get("code") for _, r in records)
    assert codes[None] > 0 and codes["batch_cancelled"] > 0
    assert set(codes) <= {None, "batch_cancelled"}


def test_cancel_check_asks_storage_at_most_every_interval(tmp_path, tiny_chat_model):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    now = [0.0]
    check = CancelCheck(job, every=1.0, clock=lambda: now[0])
    assert not check()
    job.join("cancel").write_if_absent(b'{"at": 1}')
    now[0] = 0.5
    assert not check()  # not asked again yet
    now[0] = 1.0
    assert check() and cancel_requested(job)


def test_cancelled_job_keeps_finished_lines(tmp_path, slow_llm, tiny_chat_model):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400)
    assert len(sub.messages) >= 3
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    first, running, pending = sub.messages[0], sub.messages[1], sub.messages[2:]
    assert record_attempt(job, first.shard_id, 3) == 1
    assert write_shard_result(job, first.shard_id, _run(slow_llm, job, first))
    assert record_attempt(job, running.shard_id, 3) == 1  # a worker holds it

    result = cancel_job(job)
    assert result.changed and result.status == "cancelling"
    assert result.skipped_shards == len(pending)
    assert json.loads(read_bytes(job.join("batch.json")))["status"] == "cancelling"
    assert job_status(job)["status"] == "cancelling"
    assert try_finalize(job) is None  # the running shard is not accounted for yet

    # The running shard's worker sees the marker between steps.
    records = _run(slow_llm, job, running, should_stop=CancelCheck(job, every=0))
    assert all(r["error"]["code"] == "batch_cancelled" for _, r in records)
    assert write_shard_result(job, running.shard_id, records)
    record = try_finalize(job)
    assert record is not None and record.status == "cancelled"

    folder = Path(sub.dir_uri)
    out, err = read_jsonl(folder / "output.jsonl"), read_jsonl(folder / "errors.jsonl")
    first_ids = {r.custom_id for r in read_shard(first)}
    assert {x["custom_id"] for x in out} == first_ids  # finished lines kept
    cancelled = [e for e in err if e["error"]["code"] == "batch_cancelled"]
    expected = {r.custom_id for m in sub.messages[1:] for r in read_shard(m)}
    assert Counter(e["custom_id"] for e in cancelled) == Counter(expected)
    batch = json.loads((folder / "batch.json").read_text())
    assert batch["status"] == "cancelled" and batch["completed_at"] is None
    assert batch["cancelled_at"] and batch["cancelling_at"]
    assert batch["request_counts"]["completed"] == len(first_ids)
    assert batch["request_counts"]["total"] == len(out) + len(err)
    status = job_status(job)
    assert status["status"] == "cancelled" and status["completed"] == len(first_ids)
    assert status["cancelled"] == len(expected) and status["eta_s"] == 0.0

    # Cancelling again changes nothing.
    snapshot = (folder / "batch.json").read_bytes()
    again = cancel_job(job)
    assert not again.changed and again.status == "cancelled"
    assert (folder / "batch.json").read_bytes() == snapshot


def test_cancel_after_completion_changes_nothing(tmp_path, slow_llm, tiny_chat_model):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=100_000)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    for msg in sub.messages:
        write_shard_result(job, msg.shard_id, _run(slow_llm, job, msg))
    assert try_finalize(job).status == "completed"
    snapshot = read_bytes(job.join("batch.json"))
    result = cancel_job(job)
    assert not result.changed and result.status == "completed"
    assert read_bytes(job.join("batch.json")) == snapshot
    assert not cancel_requested(job)


def test_status_and_cancel_commands(tmp_path, tiny_chat_model, capsys):
    from kvbatch.cli import main

    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400)
    out = str(tmp_path / "out")
    assert main(["status", sub.job_id, "--output", out]) == 0
    text = capsys.readouterr().out
    assert "in_progress" in text and f"0 / {len(sub.messages)} written" in text
    assert main(["status", "job-missing", "--output", out]) == 1
    assert "no job 'job-missing'" in capsys.readouterr().err
    assert main(["cancel", sub.job_id, "--output", out]) == 0
    assert "cancelled" in capsys.readouterr().out  # nothing was running: cancelled at once
    assert main(["status", sub.job_id, "--output", out, "--json", "--watch"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["status"] == "cancelled" and status["cancelled"] == sub.num_requests
    assert main(["cancel", sub.job_id, "--output", out]) == 0
    assert "already cancelled" in capsys.readouterr().out


def test_status_never_imports_torch(tmp_path):
    import subprocess

    code = (
        "import sys; from kvbatch.cli import main; "
        f"rc = main(['status', 'job-x', '--output', {str(tmp_path)!r}]); "
        "assert 'torch' not in sys.modules and 'celery' not in sys.modules, 'imported'; "
        "sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "imported" not in done.stderr, done.stderr

"""Why a shard waits, in `kvbatch status` (kvbatch/jobs/distributed/waiting.py): the note of a
worker whose model is not the job's, until a worker claims the shard; and a hint for a job
that no worker has taken a shard of."""

from __future__ import annotations

import time

from kvbatch.jobs.distributed.finalize import job_status, read_manifest, record_attempt
from kvbatch.jobs.distributed.shards import job_dir
from kvbatch.jobs.distributed.waiting import UNCLAIMED_HINT_S, note_waiting
from kvbatch.worker.cli import format_status
from tests.jobs.distributed.test_submit import prepare, rag_lines


def test_a_wait_note_shows_until_the_shard_is_claimed(tmp_path, tiny_chat_model):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    first, second = sub.messages[0].shard_id, sub.messages[1].shard_id
    assert job_status(job)["shard_waits"] == {}
    note_waiting(job, first, "host:1", "this worker's model is not the job's: its weights differ")
    status = job_status(job)
    assert status["shard_waits"] == {
        first: "this worker's model is not the job's: its weights differ (worker host:1)"
    }
    assert f"shard {first}  waiting: this worker's model" in format_status(status)
    time.sleep(0.01)
    assert record_attempt(job, first, 3) == 1  # a worker with the job's model took it
    note_waiting(job, second, "host:2", "other")
    assert list(job_status(job)["shard_waits"]) == [second]


def test_a_job_no_worker_took_gets_a_hint(tmp_path, tiny_chat_model):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    created = read_manifest(job)["created_at"]
    assert job_status(job, now=created + 1)["hint"] is None
    late = job_status(job, now=created + UNCLAIMED_HINT_S + 5)
    assert late["hint"].startswith(f"no worker has taken a shard in {UNCLAIMED_HINT_S + 5} s")
    assert f"can read {job.uri}" in late["hint"]
    assert f"hint           {late['hint']}" in format_status(late)
    record_attempt(job, sub.messages[0].shard_id, 3)
    assert job_status(job, now=created + UNCLAIMED_HINT_S + 5)["hint"] is None

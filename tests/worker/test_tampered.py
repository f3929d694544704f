"""Tampered and stale shard messages, on Redis and on SQS (moto), with real worker processes:
a message that does not match job.json is dropped unrun (no attempt claimed, no result
written), and the real message sent afterwards runs the shard. Marked `slow`."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from tests.redis_server import redis_server  # noqa: F401
from tests.worker.test_distributed import Workers, _chat, _env, _ids, _wait_completed, _write_input

pytestmark = pytest.mark.slow

SQS_BROKER = "sqs://testing:testing@"  # the endpoint comes from AWS_ENDPOINT_URL (s3_server)


@pytest.fixture(params=["redis", "sqs"])
def broker(request, monkeypatch) -> str:
    if request.param == "redis":
        return request.getfixturevalue("redis_server").url
    import pycurl  # noqa: F401  (kombu's SQS transport polls with it: celery[sqs])

    request.getfixturevalue("s3_server")
    monkeypatch.setenv("KVBATCH_VISIBILITY_TIMEOUT", "30")
    return SQS_BROKER


def _wait_for(workers: Workers, text: str, count: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while sum(p.read_text().count(text) for p in workers.logs) < count:
        assert time.monotonic() < deadline, workers.text()
        time.sleep(0.2)


def test_tampered_and_stale_messages_are_dropped_and_the_real_one_runs(
    broker: str, tmp_path: Path, tiny_chat_model: Path
):
    from kvbatch.broker.send import send_shard
    from kvbatch.broker.sqs import ensure_queue
    from kvbatch.jobs.distributed.shards import ShardMessage
    from kvbatch.jobs.distributed.submit import prepare_job
    from kvbatch.worker.app import make_app

    queue = f"kvbatch-{uuid.uuid4().hex[:8]}"
    lines = [_chat(i, system=i % 2 == 0) for i in range(12)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = str(tmp_path / "out")
    job = prepare_job(str(input_path), output, str(tiny_chat_model), shard_tokens=300)
    assert len(job.messages) >= 2
    first = job.messages[0]
    tampered = dataclasses.replace(first, sha256="0" * 64)
    stale_uri = first.uri.replace(first.shard_id, "shard-99999")
    stale = ShardMessage(job.job_id, "shard-99999", stale_uri, first.sha256)
    app = make_app(broker)
    ensure_queue(app, queue)
    env = _env(KVBATCH_VISIBILITY_TIMEOUT="30")
    workers = Workers(tmp_path, broker, tiny_chat_model, env, "--queue", queue,
                      "--metrics-port", "0", count=1)  # fmt: skip
    folder = tmp_path / "out" / job.job_id
    try:
        for msg in (tampered, tampered, stale):
            send_shard(app, output, msg, queue)
        _wait_for(workers, "dropping a message that does not match job.json", 3)
        assert not (folder / "attempts").exists() or not any((folder / "attempts").iterdir())
        assert not (folder / "results").exists() or not any((folder / "results").iterdir())
        for msg in job.messages:  # the real messages, later
            send_shard(app, output, msg, queue)
        record = _wait_completed(folder, workers, timeout=120)
    finally:
        workers.stop()
    assert record["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert Counter(_ids(folder / "output.jsonl")) == Counter(f"req-{i}" for i in range(12))
    attempts = sorted(p.name for p in (folder / "attempts").iterdir())
    assert attempts == [f"{m.shard_id}.1" for m in job.messages]  # none used by the fakes
    assert json.loads((folder / "errors.jsonl").read_text() or "null") is None

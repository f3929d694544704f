"""A distributed job over SQS: `kvbatch submit` and two real `kvbatch worker` processes on the
tiny chat model, with moto's server (tests/s3_server.py) as SQS. kombu's SQS transport makes
its boto3 client without an endpoint when the `sqs://` URL has no host, so botocore takes
AWS_ENDPOINT_URL (set by the `s3_server` fixture); workers poll with pycurl. Marked `slow`."""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter

import pytest

from tests.worker.test_distributed import (
    Workers,
    _answers,
    _chat,
    _env,
    _ids,
    _submit,
    _wait_completed,
    _write_input,
)

pytestmark = pytest.mark.slow

import pycurl  # noqa: E402,F401  (kombu's SQS transport polls with it: celery[sqs])

BROKER = "sqs://testing:testing@"  # no host: the endpoint comes from AWS_ENDPOINT_URL


N_LINES = 2000


def test_sqs_jobs_two_workers_heartbeat_and_answers(
    tmp_path, s3_server, tiny_chat_model, monkeypatch
):
    """Two workers on one SQS queue (moto), visibility timeout 4 s, engine steps slowed:

    - a one-shard job three times longer than the timeout is delivered once: the worker's
      heartbeat extends the message's visibility while the other worker polls;
    - a 2,000-line job of several shards answers each custom_id once, as `kvbatch run` does;
    - kvbatch made the queue, with its dead-letter queue."""
    from kvbatch.jobs.local.run import RunOptions, run_job

    queue = f"kvbatch-{uuid.uuid4().hex[:8]}"  # its own queue on the session's moto server
    long_input = _write_input(
        tmp_path / "long.jsonl", [_chat(i, system=False, max_tokens=40) for i in range(4)]
    )
    lines = [_chat(i, system=i % 3 == 0) for i in range(N_LINES)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = tmp_path / "out"
    # submit (in this process) makes the queue: with the workers' visibility timeout.
    monkeypatch.setenv("KVBATCH_VISIBILITY_TIMEOUT", "4")
    env = _env(KVBATCH_VISIBILITY_TIMEOUT="4", KVBATCH_STEP_DELAY="0.3")
    workers = Workers(tmp_path, BROKER, tiny_chat_model, env, "--queue", queue,
                      "--metrics-port", "0")  # fmt: skip
    try:
        # Sent while the workers start: the second is polling long before the shard ends.
        long_id = _submit(BROKER, long_input, output, tiny_chat_model, "--queue", queue)
        job_id = _submit(
            BROKER, input_path, output, tiny_chat_model, "--shard-tokens", "15000",
            "--queue", queue,
        )  # fmt: skip
        job, long_job = output / job_id, output / long_id
        manifest = json.loads((job / "job.json").read_text())
        assert len(manifest["shards"]) >= 2
        (long_shard,) = json.loads((long_job / "job.json").read_text())["shards"]
        _wait_completed(long_job, workers, timeout=90)
        record = _wait_completed(job, workers, timeout=120)
    finally:
        workers.stop()

    # The long shard: delivered once, though it ran longer than three visibility timeouts.
    took = re.search(r"succeeded in ([0-9.]+)s: \{'job_id': '" + long_id, "".join(
        p.read_text() for p in workers.logs))  # fmt: skip
    assert took and float(took.group(1)) > 3 * 4, workers.text()
    attempts = sorted(p.name for p in (long_job / "attempts").iterdir())
    assert attempts == [f"{long_shard['shard_id']}.1"], workers.text()
    assert Counter(_ids(long_job / "output.jsonl")) == Counter(f"req-{i}" for i in range(4))
    logs = "".join(p.read_text() for p in workers.logs)
    assert "already written" not in logs  # no duplicate delivery either
    assert "SQS heartbeat: extended the message's visibility" in logs
    # The 2,000-line job.
    ids = _ids(job / "output.jsonl")
    assert Counter(ids) == Counter(f"req-{i}" for i in range(N_LINES))  # each exactly once
    assert record["request_counts"] == {"total": N_LINES, "completed": N_LINES, "failed": 0}
    reference = tmp_path / "ref" / "output.jsonl"
    reference.parent.mkdir()
    run_job(RunOptions(input=str(input_path), model=str(tiny_chat_model), output=str(reference),
                       engine={"device": "cpu"}))  # fmt: skip
    assert _answers(job / "output.jsonl") == _answers(reference)
    assert ids == _ids(reference)  # input order
    # kvbatch made the queue on moto's SQS, with its dead-letter queue.
    sqs = s3_server.client("sqs")
    url = sqs.get_queue_url(QueueName=queue)["QueueUrl"]
    attrs = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    assert attrs["VisibilityTimeout"] == "4"
    policy = json.loads(attrs["RedrivePolicy"])
    assert policy["deadLetterTargetArn"].endswith(f":{queue}-dlq")
    assert int(policy["maxReceiveCount"]) == 10


def test_sqs_dead_letter_queue_takes_a_message_received_too_often(s3_server, monkeypatch):
    """ensure_queue's RedrivePolicy, on moto's SQS: a message received more than
    maxReceiveCount times without being deleted moves to `<queue>-dlq`."""
    from kvbatch.broker.sqs import ensure_queue
    from kvbatch.worker.app import make_app

    monkeypatch.setenv("KVBATCH_VISIBILITY_TIMEOUT", "30")
    queue = f"kvbatch-dlq-{uuid.uuid4().hex[:8]}"
    app = make_app(BROKER)
    url = ensure_queue(app, queue, receives=2)
    assert ensure_queue(app, queue, receives=2) == url  # a queue that exists is kept
    sqs = s3_server.client("sqs")
    dlq = sqs.get_queue_url(QueueName=f"{queue}-dlq")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="never reaches a task")
    received = 0
    for _ in range(3):  # the third receive finds it moved
        got = sqs.receive_message(QueueUrl=url, VisibilityTimeout=0, WaitTimeSeconds=0)
        received += len(got.get("Messages", []))
    assert received == 2
    moved = sqs.receive_message(QueueUrl=dlq, WaitTimeSeconds=0).get("Messages", [])
    assert [m["Body"] for m in moved] == ["never reaches a task"]


def test_sqs_heartbeat_stops_at_the_12_hour_cap(s3_server):
    """A message received 12 h ago cannot be extended: the heartbeat stops without asking."""
    import time

    from kvbatch.broker.sqs import SQS_MAX_VISIBILITY, VisibilityHeartbeat

    sqs = s3_server.client("sqs")
    url = sqs.create_queue(QueueName=f"kvbatch-cap-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="x")
    (message,) = sqs.receive_message(QueueUrl=url, VisibilityTimeout=3)["Messages"]
    old = time.time() - SQS_MAX_VISIBILITY
    beat = VisibilityHeartbeat(sqs, url, message["ReceiptHandle"], 3, received=old)
    beat.start()
    beat._thread.join(timeout=5)
    assert not beat._thread.is_alive() and beat.beats == 0
    fresh = VisibilityHeartbeat(sqs, url, message["ReceiptHandle"], 3, received=time.time())
    fresh.start()
    time.sleep(4)  # past the 3 s timeout: extended, so nobody else receives it
    assert sqs.receive_message(QueueUrl=url, WaitTimeSeconds=0).get("Messages") is None
    fresh.stop()
    assert fresh.beats >= 2

"""A distributed job over SQS: `kvbatch submit` and two real `kvbatch worker` processes on the
tiny chat model, with moto's server (tests/s3_server.py) as SQS. kombu's SQS transport makes
its boto3 client without an endpoint when the `sqs://` URL has no host, so botocore takes
AWS_ENDPOINT_URL (set by the `s3_server` fixture); workers poll with pycurl. Marked `slow`."""

from __future__ import annotations

import json
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


def test_sqs_job_two_workers_answer_like_run_job(tmp_path, s3_server, tiny_chat_model):
    from jobs.run import RunOptions, run_job

    queue = f"kvbatch-{uuid.uuid4().hex[:8]}"  # its own queue on the session's moto server
    lines = [_chat(i, system=i % 3 == 0) for i in range(60)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = tmp_path / "out"
    workers = Workers(tmp_path, BROKER, tiny_chat_model, _env(), "--queue", queue,
                      "--metrics-port", "0")  # fmt: skip
    try:
        job_id = _submit(
            BROKER, input_path, output, tiny_chat_model, "--shard-tokens", "600",
            "--queue", queue,
        )  # fmt: skip
        job = output / job_id
        manifest = json.loads((job / "job.json").read_text())
        assert len(manifest["shards"]) >= 2
        record = _wait_completed(job, workers, timeout=50)
    finally:
        workers.stop()

    ids = _ids(job / "output.jsonl")
    assert Counter(ids) == Counter(f"req-{i}" for i in range(60))  # each exactly once
    assert record["request_counts"] == {"total": 60, "completed": 60, "failed": 0}
    # The messages went through moto's SQS (kombu made the queue there), not elsewhere.
    urls = s3_server.client("sqs").list_queues().get("QueueUrls", [])
    assert any(u.endswith("/" + queue) for u in urls)
    reference = tmp_path / "ref" / "output.jsonl"
    reference.parent.mkdir()
    run_job(RunOptions(input=str(input_path), model=str(tiny_chat_model), output=str(reference),
                       engine={"device": "cpu"}))  # fmt: skip
    assert _answers(job / "output.jsonl") == _answers(reference)
    assert ids == _ids(reference)  # input order

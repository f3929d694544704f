"""S3 faults at shard level, over real HTTP: moto's server behind tests/fault_proxy.py, which
answers chosen requests with 503 SlowDown, 500 or 403 AccessDenied. Real redis-server, real
`kvbatch worker` processes on the tiny chat model. Marked `slow`."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from tests.fault_proxy import FaultProxy
from tests.redis_server import redis_server  # noqa: F401
from tests.worker.test_distributed import (
    Workers,
    _chat,
    _env,
    _submit,
    _write_input,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def proxy(s3_server):
    proxy = FaultProxy(s3_server.endpoint).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def _read(s3_server, bucket: str, key: str) -> bytes:
    return s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def _lines(s3_server, bucket: str, key: str) -> list[dict]:
    return [json.loads(x) for x in _read(s3_server, bucket, key).splitlines() if x.strip()]


def _wait_batch(s3_server, bucket, prefix, workers, timeout=90) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            record = json.loads(_read(s3_server, bucket, f"{prefix}/batch.json"))
        except Exception:
            record = {}
        if record.get("status") == "completed":
            return record
        time.sleep(0.3)
    pytest.fail(f"{prefix} did not complete in {timeout} s\n{workers.text()}")


def test_s3_faults_retried_and_access_denied_fails_the_shard(
    tmp_path,
    redis_server,  # noqa: F811
    s3_server,
    proxy,
    tiny_chat_model,
):
    bucket = s3_server.make_bucket()
    lines = [_chat(i, system=i % 3 == 0) for i in range(40)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = f"s3://{bucket}/jobs"
    job_id = _submit(redis_server.url, input_path, output, tiny_chat_model,
                     "--shard-tokens", "400", "--max-attempts", "2", "--job-id", "job-faults")  # fmt: skip
    prefix = f"jobs/{job_id}"
    manifest = json.loads(_read(s3_server, bucket, f"{prefix}/job.json"))
    assert len(manifest["shards"]) >= 3
    # Throttling and 5xx that botocore's standard retries absorb (3 tries per call here).
    results = proxy.fail("PUT", r"/results/", status=503, code="SlowDown", times=2)
    manifest_5xx = proxy.fail("GET", r"/job\.json$", status=500, code="InternalError", times=2)
    # More 503s than botocore tries: claiming shard-00000's first attempt fails outside the
    # shard's run; the task retries that step and the job still completes.
    claim = proxy.fail("PUT", r"/attempts/shard-00000\.1$", status=503, code="SlowDown", times=4)
    # shard-00001's payload may not be read (a bucket policy or KMS key denies it).
    denied = proxy.fail("GET", r"/shards/shard-00001\.jsonl$", status=403, code="AccessDenied")
    env = _env(AWS_ENDPOINT_URL=proxy.endpoint, AWS_MAX_ATTEMPTS="3")
    workers = Workers(tmp_path, redis_server.url, tiny_chat_model, env, "--metrics-port", "0")
    try:  # the shards wait in Redis since submit; the rules are set before workers start
        record = _wait_batch(s3_server, bucket, prefix, workers)
    finally:
        workers.stop()

    assert results.hits == 2 and manifest_5xx.hits == 2 and claim.hits == 4
    assert denied.hits >= 2  # each attempt tried to read it
    logs = "".join(p.read_text() for p in workers.logs)
    assert "claiming an attempt failed" in logs, workers.text()
    answered = _lines(s3_server, bucket, f"{prefix}/output.jsonl")
    errors = _lines(s3_server, bucket, f"{prefix}/errors.jsonl")
    denied_shard = next(s for s in manifest["shards"] if s["shard_id"] == "shard-00001")
    assert len(errors) == denied_shard["num_requests"]
    assert {e["error"]["code"] for e in errors} == {"shard_failed"}
    message = errors[0]["error"]["message"]
    assert f"s3://{bucket}/{prefix}/shards/shard-00001.jsonl" in message, message
    assert "AccessDenied" in message and "s3:GetObject" in message, message
    every = Counter(x["custom_id"] for x in answered) + Counter(e["custom_id"] for e in errors)
    assert every == Counter(f"req-{i}" for i in range(40))  # each exactly once
    assert record["request_counts"] == {"total": 40, "completed": len(answered),
                                        "failed": len(errors)}  # fmt: skip
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(
        Bucket=bucket, Prefix=f"{prefix}/attempts/")["Contents"]]  # fmt: skip
    assert f"{prefix}/attempts/shard-00000.1" in keys
    assert f"{prefix}/attempts/shard-00000.2" not in keys  # the claim was retried, not rerun


def test_unwritable_results_are_clear_in_logs_and_status(
    tmp_path, s3_server, proxy, tiny_chat_model, monkeypatch, caplog
):
    """Results may not be written at all: every retry fails, the shard cannot even be failed,
    and the reason (bucket, key, permission) is in the log and in `kvbatch status`."""
    from kvbatch.jobs.distributed.finalize import job_status
    from kvbatch.jobs.distributed.shards import job_dir
    from kvbatch.jobs.distributed.submit import prepare_job
    from kvbatch.jobs.storage.s3 import reset_client
    from kvbatch.worker.app import TASK_NAME, make_app
    from kvbatch.worker.tasks import WorkerModel

    bucket = s3_server.make_bucket()
    input_path = _write_input(tmp_path / "input.jsonl", [_chat(i, system=False) for i in range(6)])
    output = f"s3://{bucket}/jobs"
    job = prepare_job(str(input_path), output, str(tiny_chat_model), max_attempts=2)
    (msg,) = job.messages
    proxy.fail("PUT", r"/results/", status=403, code="AccessDenied")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    reset_client()
    try:
        task = make_app("redis://127.0.0.1:1/0").tasks[TASK_NAME]
        task.use_model(WorkerModel(str(tiny_chat_model), {"device": "cpu"}))
        with caplog.at_level("INFO", logger="kvbatch.worker"):
            result = task.apply(kwargs={"output": output, "shard": msg.to_dict()})
        assert result.state == "FAILURE", result.traceback
        status = job_status(job_dir(output, job.job_id))
    finally:
        monkeypatch.undo()
        reset_client()
    assert status["status"] == "in_progress"
    (reason,) = status["shard_failures"].values()
    where = f"s3://{bucket}/jobs/{job.job_id}/results/{msg.shard_id}.jsonl"
    assert where in reason and "s3:PutObject" in reason, reason
    logged = caplog.text
    assert "cannot record the shard's failure either" in logged
    assert re.search(r"access denied writing .*s3:PutObject", logged), logged


def test_submit_marks_the_job_failed_when_sending_fails(
    tmp_path,
    redis_server,  # noqa: F811
    tiny_chat_model,
    monkeypatch,
    capsys,
):
    """The broker answers submit's check, then sending the second shard fails: the job folder
    is written, so batch.json says failed, with the reason, and `kvbatch status` shows it."""
    import kvbatch.broker.send
    from kvbatch.cli import main

    real_send, sent = kvbatch.broker.send.send_shard, []

    def send_then_fail(app, output, message, queue):
        if sent:
            raise ConnectionError("the broker went away")
        sent.append(message)
        real_send(app, output, message, queue)

    monkeypatch.setattr(kvbatch.broker.send, "send_shard", send_then_fail)
    input_path = _write_input(
        tmp_path / "input.jsonl", [_chat(i, system=i % 2 == 0) for i in range(20)]
    )
    output = tmp_path / "out"
    argv = ["submit", str(input_path), "--output", str(output), "--model", str(tiny_chat_model),
            "--broker", redis_server.url, "--shard-tokens", "200", "--job-id", "job-send"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "job job-send" in err and "the broker went away" in err
    batch = json.loads((output / "job-send" / "batch.json").read_text())
    assert batch["status"] == "failed" and batch["failed_at"]
    (error,) = batch["errors"]["data"]
    assert error["code"] == "send_failed" and "the broker went away" in error["message"]
    assert main(["status", "job-send", "--output", str(output)]) == 0
    shown = capsys.readouterr().out
    assert "failed" in shown and "the broker went away" in shown

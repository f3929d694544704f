"""`kvbatch cancel` on a real job: Redis, one `kvbatch worker` process on the tiny chat model,
a job of several slow shards cancelled once the first shard's result is written. Marked slow."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import pytest

from tests.redis_server import redis_server  # noqa: F401
from tests.worker.test_distributed import REPO, _chat, _cli, _env, _ids, _submit, _write_input

pytestmark = pytest.mark.slow


def test_cancel_keeps_finished_lines(tmp_path, redis_server, tiny_chat_model):  # noqa: F811
    lines = [_chat(i, system=i % 3 == 0, max_tokens=32) for i in range(60)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = tmp_path / "out"
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        _cli("worker", "--model", str(tiny_chat_model), "--broker", redis_server.url,
             "--device", "cpu", "--max-num-seqs", "2"),
        cwd=REPO, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        job_id = _submit(
            redis_server.url, input_path, output, tiny_chat_model, "--shard-tokens", "800"
        )
        job = output / job_id
        shards = json.loads((job / "job.json").read_text())["shards"]
        assert len(shards) >= 3
        deadline = time.monotonic() + 60
        while not any((job / "results").glob("*.jsonl")):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        cancel = subprocess.run(
            _cli("cancel", job_id, "--output", str(output)),
            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert cancel.returncode == 0, cancel.stderr
        deadline = time.monotonic() + 60
        while True:
            batch = job / "batch.json"
            record = json.loads(batch.read_text())
            if record["status"] == "cancelled":
                break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        if worker.poll() is None:
            worker.terminate()
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()

    answered = _ids(job / "output.jsonl")
    errors = [json.loads(x) for x in (job / "errors.jsonl").read_text().splitlines() if x]
    assert answered, "the first shard's lines are kept"
    assert errors and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    every = Counter(answered) + Counter(e["custom_id"] for e in errors)
    assert every == Counter(f"req-{i}" for i in range(60))  # each exactly once
    assert record["request_counts"] == {
        "total": 60,
        "completed": len(answered),
        "failed": 60 - len(answered),
    }

    status = subprocess.run(
        _cli("status", job_id, "--output", str(output), "--json"),
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    counts = json.loads(status.stdout)
    assert counts["status"] == "cancelled"
    assert (counts["completed"], counts["cancelled"]) == (len(answered), len(errors))
    missing = subprocess.run(
        _cli("status", "job-nope", "--output", str(output)),
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 1 and "no job" in missing.stderr

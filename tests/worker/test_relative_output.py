"""`kvbatch submit ... --output out/jobs` from one folder, a worker started in another: the job
and its messages hold the absolute path, so the worker finds the job and answers it; a message
that still carries a relative prefix (an older client) is refused with the path named. Real
Redis, a real `kvbatch worker` process. Marked `slow`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.redis_server import redis_server  # noqa: F401
from tests.worker.test_distributed import (
    REPO,
    Workers,
    _chat,
    _cli_in_process,
    _env,
    _submit,
    _wait_completed,
    _write_input,
)
from tests.worker.test_tampered import _wait_for

pytestmark = pytest.mark.slow


def test_a_relative_output_reaches_a_worker_started_elsewhere(
    tmp_path: Path,
    redis_server,  # noqa: F811
    tiny_chat_model: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    from kvbatch.broker.send import send_shard
    from kvbatch.jobs.distributed.shards import ShardMessage
    from kvbatch.worker.app import make_app

    client = tmp_path / "client"
    client.mkdir()
    _write_input(client / "job.jsonl", [_chat(i, system=i % 2 == 0) for i in range(6)])
    workers = Workers(
        tmp_path, redis_server.url, tiny_chat_model, _env(), "--metrics-port", "0", count=1
    )  # fmt: skip  (its working folder: the repository)
    monkeypatch.chdir(client)
    assert Path.cwd() != REPO
    try:
        job_id = _submit(redis_server.url, Path("job.jsonl"), Path("out/jobs"), tiny_chat_model,
                         "--shard-tokens", "300")  # fmt: skip
        folder = client / "out" / "jobs" / job_id
        record = _wait_completed(folder, workers, timeout=120)
        assert record["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
        manifest = json.loads((folder / "job.json").read_text())
        assert manifest["input"] == str(client / "job.jsonl")
        assert all(s["uri"].startswith(f"{folder}/shards/") for s in manifest["shards"])

        first = manifest["shards"][0]
        relative = f"out/jobs/{job_id}/shards/{first['shard_id']}.jsonl"
        old_style = ShardMessage(job_id, first["shard_id"], relative, first["sha256"])
        send_shard(make_app(redis_server.url), "out/jobs", old_style, "kvbatch")
        _wait_for(workers, "output prefix 'out/jobs' is a relative path", 1)
        assert f"not under this worker's ({REPO})" in workers.text()
    finally:
        workers.stop()
    code, out, err = _cli_in_process("status", job_id, "--output", "out/jobs")
    assert code == 0 and "completed" in out, err

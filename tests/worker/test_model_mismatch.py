"""A worker started on another checkpoint than the job's leaves the job's shards to a worker
that has it: real Redis, real `kvbatch worker` processes, two tiny checkpoints with the same
config and tokenizer and other weights (only the fingerprint's sampled weight bytes differ).
Marked `slow`."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.redis_server import redis_server  # noqa: F401
from tests.tiny_models import build_tiny_chat_checkpoint
from tests.worker.test_distributed import (
    Workers,
    _chat,
    _cli_in_process,
    _env,
    _ids,
    _submit,
    _wait_completed,
    _write_input,
)
from tests.worker.test_tampered import _wait_for

pytestmark = pytest.mark.slow

LEFT = "leaving it for a worker with the job's model"


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, smollm2_dir: Path) -> Path:
    """tiny_chat_model's twin of seed 1: same files, same sizes, other weights."""
    return build_tiny_chat_checkpoint(tmp_path_factory.mktemp("seed1") / "model", smollm2_dir, 1)


def test_a_worker_with_another_model_leaves_the_shards_to_one_with_the_jobs(
    tmp_path: Path,
    redis_server,  # noqa: F811
    tiny_chat_model: Path,
    other_model: Path,
):
    input_path = _write_input(
        tmp_path / "input.jsonl", [_chat(i, system=i % 2 == 0) for i in range(8)]
    )  # noqa: E501
    output = tmp_path / "out"
    env = _env(KVBATCH_VISIBILITY_TIMEOUT="30")
    for name in ("wrong", "right"):
        (tmp_path / name).mkdir()
    wrong = Workers(tmp_path / "wrong", redis_server.url, other_model, env, "--metrics-port", "0",
                    count=1)  # fmt: skip
    right = None
    try:
        job_id = _submit(
            redis_server.url, input_path, output, tiny_chat_model, "--shard-tokens", "300"
        )  # noqa: E501
        folder = output / job_id
        manifest = json.loads((folder / "job.json").read_text())
        shards = [s["shard_id"] for s in manifest["shards"]]
        assert len(shards) >= 2
        _wait_for(wrong, LEFT, 2 * len(shards))  # each offered to it at least twice
        assert not (folder / "attempts").exists() and not (folder / "results").exists()
        assert "its weights differ" in wrong.text()
        code, out, err = _cli_in_process("status", job_id, "--output", str(output))
        assert code == 0, err
        for shard_id in shards:
            assert f"shard {shard_id}" in out
        assert out.count("waiting: this worker's model") == len(shards), out
        assert "its weights differ" in out and str(other_model) in out, out

        # The wrong worker stops first: on one shared queue it re-takes the shards it sends
        # back faster than another worker polls (docs/DISTRIBUTED.md: a queue per model).
        # Its warm shutdown returns the messages it holds; none has used an attempt.
        wrong.stop()
        right = Workers(tmp_path / "right", redis_server.url, tiny_chat_model, env,
                        "--metrics-port", "0", count=1)  # fmt: skip
        record = _wait_completed(folder, right, timeout=150)
    finally:
        wrong.stop()
        if right is not None:
            right.stop()
    assert record["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    assert Counter(_ids(folder / "output.jsonl")) == Counter(f"req-{i}" for i in range(8))
    # no attempt used up by the wrong worker: one each, all by the right one
    assert sorted(p.name for p in (folder / "attempts").iterdir()) == [f"{s}.1" for s in shards]
    assert "attempt 1 of" not in wrong.text() and "attempt 1 of" in right.text()
    code, out, _ = _cli_in_process("status", job_id, "--output", str(output))
    assert code == 0 and "waiting:" not in out and "completed" in out

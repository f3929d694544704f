"""Chaos on a distributed job: three real workers on Redis with a visibility timeout shorter
than a shard's run (so shards are handed out again while they still run), workers SIGKILLed
at random moments and replaced, and duplicate and tampered messages on the queue. Every
custom_id must come out exactly once, and no good line may be answered as shard_failed.

The suite runs one short round (a couple of minutes on a busy 2-core machine). A longer soak
runs the same test with more lines and kills:

    KVBATCH_CHAOS_LINES=400 KVBATCH_CHAOS_KILLS=8 KVBATCH_CHAOS_SEED=7 \\
        .venv/bin/python -m pytest -q tests/worker/test_chaos.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.redis_server import redis_server  # noqa: F401
from tests.worker.test_distributed import Workers, _chat, _env, _ids, _submit, _write_input

pytestmark = pytest.mark.slow

LINES = int(os.environ.get("KVBATCH_CHAOS_LINES", "60"))
KILLS = int(os.environ.get("KVBATCH_CHAOS_KILLS", "2"))
SEED = int(os.environ.get("KVBATCH_CHAOS_SEED", "0"))


def test_random_kills_duplicates_and_tampering_answer_each_line_once(
    tmp_path: Path,
    redis_server,  # noqa: F811
    tiny_chat_model: Path,
):
    from kvbatch.broker.send import send_shard
    from kvbatch.jobs.distributed.shards import ShardMessage
    from kvbatch.worker.app import make_app

    rng = random.Random(SEED)
    lines = [_chat(i, system=i % 3 == 0, max_tokens=24) for i in range(LINES)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = tmp_path / "out"
    # A shard runs ~25 steps x 0.25 s, several times the 3 s visibility timeout: it is handed
    # out again while it runs, to whichever worker is idle.
    env = _env(
        KVBATCH_VISIBILITY_TIMEOUT="3",
        KVBATCH_STEP_DELAY="0.25",
        KVBATCH_RUNNING_HEARTBEAT="1",
    )
    workers = Workers(tmp_path, redis_server.url, tiny_chat_model, env, "--metrics-port", "0",
                      count=3)  # fmt: skip
    # Each kill may cost its shard one attempt; redeliveries must cost none.
    max_attempts = KILLS + 2
    try:
        job_id = _submit(redis_server.url, input_path, output, tiny_chat_model,
                         "--shard-tokens", "900", "--max-attempts", str(max_attempts))  # fmt: skip
        job = output / job_id
        manifest = json.loads((job / "job.json").read_text())
        assert len(manifest["shards"]) >= 3
        app = make_app(redis_server.url)
        for entry in rng.sample(manifest["shards"], 2):
            real = ShardMessage(job_id, entry["shard_id"], entry["uri"], entry["sha256"])
            send_shard(app, str(output), real, "kvbatch")  # a duplicate
            fake = dataclasses.replace(real, sha256=f"{rng.getrandbits(256):064x}")
            send_shard(app, str(output), fake, "kvbatch")  # a tampered copy
        kills = 0
        deadline = time.monotonic() + 420
        while not _completed(job):
            assert time.monotonic() < deadline, workers.text()
            if kills < KILLS and any((job / "attempts").glob("*")):
                time.sleep(rng.uniform(2, 6))
                alive = [p for p in workers.procs if p.poll() is None]
                victim = rng.choice(alive)
                victim.kill()  # SIGKILL: no ack, no reject, no clean-up
                victim.wait()
                kills += 1
                workers.start()
            time.sleep(0.2)
    finally:
        workers.stop()

    answered = _ids(job / "output.jsonl")
    errors = [json.loads(x) for x in (job / "errors.jsonl").read_text().splitlines() if x]
    assert not [e for e in errors if e["error"]["code"] == "shard_failed"], workers.text()
    assert Counter(answered + [e["custom_id"] for e in errors]) == Counter(
        f"req-{i}" for i in range(LINES)
    )
    assert not errors
    logs = "".join(p.read_text() for p in workers.logs)
    assert "dropping a message that does not match job.json" in logs
    print(f"chaos: {kills} kills, {logs.count('delivering again in')} redeliveries deferred")


def _completed(job: Path) -> bool:
    batch = job / "batch.json"
    return batch.exists() and json.loads(batch.read_text())["status"] == "completed"

"""A distributed job end to end: `kvbatch submit`, real Redis, two real `kvbatch worker`
processes on the tiny chat model. Slow (worker start-up imports torch): marked `slow`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.processes import stop_processes
from tests.redis_server import persistent_redis_server, redis_server  # noqa: F401

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SYSTEM = (
    "You are a careful assistant for a library catalogue. Answer in one short sentence, cite "
    "the shelf mark when you know it, and never invent a book that is not in the catalogue. "
) * 3


def _chat(i: int, *, system: bool, max_tokens: int = 4) -> dict:
    """Chat line i: the long shared system prompt, or one of four short ones (prefix groups
    of their own, so the job splits into several shards)."""
    prompt = SYSTEM if system else f"Desk {i % 4} answers. Be brief."
    messages = [{"role": "system", "content": prompt}]
    messages.append({"role": "user", "content": f"Question {i}: where is book number {i * 7}?"})
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny-chat",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def _write_input(path: Path, lines: list) -> Path:
    with path.open("w") as f:
        for line in lines:
            f.write(line if isinstance(line, str) else json.dumps(line))
            f.write("\n")
    return path


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvbatch.cli", *args]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    env.pop("KVBATCH_BROKER_URL", None)
    env.update(extra)
    return env


def _submit(broker: str, input_path: Path, output: Path, model: Path, *args: str) -> str:
    """`kvbatch submit` through its CLI entry point, in this process: a subprocess would pay
    for importing transformers again (seconds on a busy machine) for each job."""
    code, out, err = _cli_in_process(
        "submit", str(input_path), "--output", str(output), "--model", str(model),
        "--broker", broker, *args,
    )  # fmt: skip
    assert code == 0, err
    return out.strip().splitlines()[-1]


def _cli_in_process(*argv: str) -> tuple[int, str, str]:
    """A `kvbatch` command run in this process: its exit code, stdout and stderr."""
    import contextlib
    import io

    from kvbatch.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


class Workers:
    """`kvbatch worker` processes, each logging to its own file."""

    def __init__(self, tmp: Path, broker: str, model: Path, env: dict, *extra: str, count: int = 2):
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self._tmp, self._env = tmp, env
        self._args = _cli("worker", "--model", str(model), "--broker", broker, "--device", "cpu",
                          *extra)  # fmt: skip
        for _ in range(count):
            self.start()

    def start(self) -> subprocess.Popen:
        """One more worker (logging to worker-<n>.log)."""
        log = self._tmp / f"worker-{len(self.logs)}.log"
        self.logs.append(log)
        proc = subprocess.Popen(
            self._args, cwd=REPO, env=self._env, stdout=log.open("w"), stderr=subprocess.STDOUT
        )
        self.procs.append(proc)
        return proc

    def text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs)

    def stop(self) -> None:
        stop_processes(self.procs)


def _wait_completed(job: Path, workers: Workers, timeout: float = 75) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = job / "batch.json"
        if batch.exists():
            record = json.loads(batch.read_text())
            if record["status"] == "completed":
                return record
        time.sleep(0.2)
    pytest.fail(f"job {job.name} did not complete in {timeout} s\n{workers.text()}")


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["custom_id"] for line in path.read_text().splitlines() if line]


def _answers(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        item = json.loads(line)
        out[item["custom_id"]] = item["response"]["body"]["choices"][0]["message"]["content"]
    return out


def test_two_workers_answer_like_run_job(tmp_path, persistent_redis_server, tiny_chat_model):  # noqa: F811
    """2,000 lines (plus a bad line and a duplicate custom_id), two workers, one shard message
    sent twice, and Redis SIGKILLed and restarted (from its append-only file) once the first
    shard is written, then `kvbatch resend` (a worker whose BRPOP was in flight at the kill
    lost that shard: broker/resend.py): every custom_id is answered exactly once, as
    `kvbatch run` answers it. (~30 s on an idle 2-core machine.)"""
    from kvbatch.broker.send import send_shard
    from kvbatch.jobs.distributed.shards import ShardMessage
    from kvbatch.jobs.local.run import RunOptions, run_job
    from kvbatch.worker.app import make_app

    redis = persistent_redis_server
    n = 2000
    lines: list = [_chat(i, system=i % 3 == 0) for i in range(n)]
    lines.insert(17, "this is not JSON")
    lines.insert(60, _chat(5, system=False))  # a duplicate custom_id
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = tmp_path / "out"
    # A shard stranded unacknowledged by the restart comes back after the visibility timeout;
    # slowed steps leave shards to run after the restart.
    env = _env(KVBATCH_VISIBILITY_TIMEOUT="15", KVBATCH_STEP_DELAY="0.1")
    workers = Workers(tmp_path, redis.url, tiny_chat_model, env, "--metrics-port", "0")
    started = time.monotonic()
    try:
        job_id = _submit(redis.url, input_path, output, tiny_chat_model, "--shard-tokens", "15000")
        job = output / job_id
        manifest = json.loads((job / "job.json").read_text())
        assert len(manifest["shards"]) >= 3
        # Deliver one shard twice: it must still be answered once.
        first = manifest["shards"][0]
        duplicate = ShardMessage(job_id, first["shard_id"], first["uri"], first["sha256"])
        send_shard(make_app(redis.url), str(output), duplicate, "kvbatch")
        deadline = time.monotonic() + 60
        while not any((job / "results").glob("*.jsonl")):
            assert time.monotonic() < deadline, workers.text()
            time.sleep(0.05)
        before = [log.stat().st_size if log.exists() else 0 for log in workers.logs]
        redis.restart(down=1.0)
        pending = len(manifest["shards"]) - len(list((job / "results").glob("*.jsonl")))
        # The operator's step after a broker restart. The append-only file kept the queue
        # and the unacknowledged deliveries: at most the one pop each worker had in flight
        # is lost.
        code, out, err = _cli_in_process(
            "resend", job_id, "--output", str(output), "--broker", redis.url
        )
        assert code == 0, err
        assert len(out.splitlines()[1:]) <= len(workers.procs), out
        record = _wait_completed(job, workers, timeout=120)
    finally:
        workers.stop()
    print(f"{n} lines over Redis: {time.monotonic() - started:.1f} s from start-up; "
          f"{pending} of {len(manifest['shards'])} shards pending at the restart; {out}")  # fmt: skip
    assert pending > 0, "the job ended before the restart"
    # Each worker went on consuming after the restart (NOTES.md: workers can silently stop
    # after a Redis reconnect). Whether a worker logs the lost connection depends on timing (a
    # busy solo worker's client may reconnect on its next command), so judge by what it does.
    for log, size in zip(workers.logs, before):
        after = log.read_bytes()[size:].decode(errors="replace")
        assert "received" in after, workers.text()

    ids = _ids(job / "output.jsonl")
    assert Counter(ids) == Counter(f"req-{i}" for i in range(n))  # each exactly once
    assert record["request_counts"] == {"total": n + 2, "completed": n, "failed": 2}
    errors = [json.loads(x) for x in (job / "errors.jsonl").read_text().splitlines()]
    assert [e["error"]["line"] for e in errors] == [18, 61]  # not JSON; duplicate custom_id
    reference = tmp_path / "ref" / "output.jsonl"
    reference.parent.mkdir()
    run_job(RunOptions(input=str(input_path), model=str(tiny_chat_model), output=str(reference),
                       engine={"device": "cpu"}))  # fmt: skip
    assert _answers(job / "output.jsonl") == _answers(reference)
    assert ids == _ids(reference)  # input order


def test_killed_worker_shard_is_delivered_again(tmp_path, redis_server, tiny_chat_model):  # noqa: F811
    # One slow shard: each engine step sleeps 0.3 s (about 3 s a run), so it is still running
    # when its worker is killed.
    lines = [_chat(i, system=False, max_tokens=8) for i in range(16)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = tmp_path / "out"
    env = _env(KVBATCH_VISIBILITY_TIMEOUT="6", KVBATCH_STEP_DELAY="0.3")
    workers = Workers(tmp_path, redis_server.url, tiny_chat_model, env, "--metrics-port", "0")
    try:
        # Both workers up (their logs say so) before the shard is sent.
        deadline = time.monotonic() + 60
        while sum("ready." in p.read_text() for p in workers.logs) < 2:
            assert time.monotonic() < deadline, workers.text()
            time.sleep(0.2)
        job_id = _submit(redis_server.url, input_path, output, tiny_chat_model)
        job = output / job_id
        shard_id = json.loads((job / "job.json").read_text())["shards"][0]["shard_id"]
        marker = job / "attempts" / f"{shard_id}.1"
        deadline = time.monotonic() + 30
        running = None
        while running is None:
            assert time.monotonic() < deadline, workers.text()
            if marker.exists():
                for proc, log in zip(workers.procs, workers.logs):
                    if f"{shard_id}: attempt 1" in log.read_text():
                        running = proc
            time.sleep(0.05)
        running.kill()  # SIGKILL mid-shard: no chance to ack, reject or clean up
        running.wait()
        assert not (job / "results" / f"{shard_id}.jsonl").exists(), "the shard ended too soon"
        _wait_completed(job, workers, timeout=80)
    finally:
        workers.stop()
    assert (job / "attempts" / f"{shard_id}.2").exists()  # delivered again
    ids = _ids(job / "output.jsonl")
    assert Counter(ids) == Counter(f"req-{i}" for i in range(16))


def test_poison_shard_becomes_error_records(tmp_path, tiny_chat_model):
    """A shard whose payload was changed after submit can never run: its lines become error
    records at its first attempt and the job still completes (the task run in-process,
    eagerly)."""
    from celery.exceptions import Reject

    from kvbatch.jobs.distributed.submit import prepare_job
    from kvbatch.worker.app import TASK_NAME, make_app
    from kvbatch.worker.tasks import WorkerModel

    lines = [_chat(i, system=i % 2 == 0) for i in range(40)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = str(tmp_path / "out")
    job = prepare_job(str(input_path), output, str(tiny_chat_model), shard_tokens=300)
    assert len(job.messages) >= 2
    poison = job.messages[0]
    with open(poison.uri, "ab") as f:  # the payload no longer matches its sha256: raises
        f.write(b"\n")
    task = make_app("redis://127.0.0.1:1/0").tasks[TASK_NAME]
    task.use_model(WorkerModel(str(tiny_chat_model), {"device": "cpu"}))
    for msg in job.messages:
        task.apply(kwargs={"output": output, "shard": msg.to_dict()}).get()
    folder = tmp_path / "out" / job.job_id
    # No attempt of a payload that does not match its sha256 can succeed: failed at once.
    assert sorted(p.name for p in (folder / "attempts").glob(f"{poison.shard_id}.*")) == [
        f"{poison.shard_id}.1"
    ]
    record = json.loads((folder / "batch.json").read_text())
    assert record["status"] == "completed"
    errors = [json.loads(x) for x in (folder / "errors.jsonl").read_text().splitlines()]
    failed = {e["custom_id"] for e in errors}
    assert errors and {e["error"]["code"] for e in errors} == {"shard_failed"}
    answered = set(_ids(folder / "output.jsonl"))
    assert not failed & answered
    assert failed | answered == {f"req-{i}" for i in range(40)}
    # A message that points outside its job is refused for good, never run.
    bad = {**job.messages[1].to_dict(), "uri": "/etc/passwd/x/shards/shard-00001.jsonl"}
    result = task.apply(kwargs={"output": output, "shard": bad})
    assert result.state == "REJECTED" and isinstance(result.result, Reject)


def test_a_shard_that_raises_each_time_is_retried_then_failed(tmp_path, tiny_chat_model):
    """A shard whose run raises on every attempt (here: the worker's model cannot load) is
    retried up to max_attempts, then its lines become shard_failed error records and the job
    completes (the task run in-process, eagerly: Celery runs each retry at once)."""
    from kvbatch.jobs.distributed.submit import prepare_job
    from kvbatch.worker.app import TASK_NAME, make_app
    from kvbatch.worker.tasks import WorkerModel

    input_path = _write_input(tmp_path / "input.jsonl", [_chat(i, system=False) for i in range(4)])
    output = str(tmp_path / "out")
    job = prepare_job(str(input_path), output, str(tiny_chat_model), max_attempts=3)
    (msg,) = job.messages
    task = make_app("redis://127.0.0.1:1/0").tasks[TASK_NAME]
    task.use_model(WorkerModel(str(tmp_path / "no-such-model"), {"device": "cpu"}))
    task.apply(kwargs={"output": output, "shard": msg.to_dict()})
    folder = tmp_path / "out" / job.job_id
    assert sorted(p.name for p in (folder / "attempts").iterdir()) == [
        f"{msg.shard_id}.{n}" for n in (1, 2, 3)
    ]
    assert json.loads((folder / "batch.json").read_text())["status"] == "completed"
    errors = [json.loads(x) for x in (folder / "errors.jsonl").read_text().splitlines()]
    assert [e["error"]["code"] for e in errors] == ["shard_failed"] * 4
    assert "no-such-model" in errors[0]["error"]["message"]

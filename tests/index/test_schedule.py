"""A schedule's `index` entry: beat's trigger sends one task message per run date (a duplicate
trigger is a no-op), and a real `kvbatch index-worker` runs the index on a real embedding
worker through real Redis, recording the run."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from kvbatch.index.distributed import model_queue
from kvbatch.index.spec import load_spec
from kvbatch.worker.app import make_app
from kvbatch.worker.index_trigger import INDEX_QUEUE, IndexRunRequest, run_record
from kvbatch.worker.schedule import IndexEntry, ScheduleError, parse_schedule
from kvbatch.worker.scheduled import start_scheduled_run
from tests.index.indexing import index_spec, table_rows
from tests.processes import stop_processes
from tests.redis_server import redis_server  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


def _index_entry(spec: Path | str, **over) -> dict:
    return {"name": "docs-index", "cron": "0 2 * * *", "index": str(spec), **over}


def test_an_index_entry_takes_output_and_models_from_its_spec():
    (entry,) = parse_schedule({"jobs": [_index_entry("index.toml")]}).jobs
    assert isinstance(entry, IndexEntry) and entry.index == "index.toml"
    with pytest.raises(ScheduleError, match=r"job 'docs-index': model: unknown field"):
        parse_schedule({"jobs": [_index_entry("index.toml", model="m")]})
    with pytest.raises(ScheduleError, match=r"job 'docs-index': input: unknown field"):
        parse_schedule({"jobs": [_index_entry("index.toml", input="in.jsonl")]})
    with pytest.raises(ScheduleError, match=r"job 'docs-index': cron: "):
        parse_schedule({"jobs": [_index_entry("index.toml", cron="bad")]})
    with pytest.raises(ScheduleError, match=r"job 'n': output: missing"):
        parse_schedule({"jobs": [{"name": "n", "cron": "0 2 * * *", "model": "m", "input": "i"}]})


def test_an_index_run_message_names_a_run_date():
    assert IndexRunRequest("/specs/index.toml", "2026-03-01", "docs-index").to_kwargs()["run_key"]
    with pytest.raises(ValueError):
        IndexRunRequest("/specs/index.toml", "../../etc/passwd", "docs-index")


def _json(file) -> dict:
    with file.open_read() as f:
        return json.loads(f.read())


def _process(tmp: Path, name: str, *args: str, env: dict) -> subprocess.Popen:
    log = (tmp / f"{name}.log").open("w")
    cmd = [sys.executable, "-m", "kvbatch.cli", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_scheduled_index_run_is_sent_once_and_run_by_the_index_worker(
    tmp_path,
    redis_server,  # noqa: F811
    s3_server,
    minilm,
):
    """The table and the run folder on S3 (the run record among them): the index worker and
    the model worker see the run only through the bucket."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "tides.txt").write_text("Tides rise and fall twice a day as the Moon pulls the sea.")
    (docs / "reefs.txt").write_text("Coral reefs are built by tiny polyps over many centuries.")
    bucket = s3_server.make_bucket()
    # the embed stage only: one model worker; [output] last in the file, so this one wins
    spec = index_spec(tmp_path, docs, None, minilm)
    text = (tmp_path / "index.toml").read_text()
    text = text.replace(f'uri = "{tmp_path / "index"}"', f'uri = "s3://{bucket}/index"')
    (tmp_path / "index.toml").write_text(text)
    spec = load_spec(tmp_path / "index.toml")
    assert spec.output.runs == f"s3://{bucket}/index.runs"
    (entry,) = parse_schedule({"jobs": [_index_entry(tmp_path / "index.toml")]}).jobs
    app = make_app(redis_server.url)
    day = dt.date(2026, 3, 1)
    assert start_scheduled_run(entry, day, app=app) == "docs-index-2026-03-01"
    assert start_scheduled_run(entry, day, app=app) is None  # a duplicate trigger: no message
    queued = redis.Redis.from_url(redis_server.url).lrange(INDEX_QUEUE, 0, -1)
    assert len(queued) == 1
    message = json.loads(queued[0])
    assert message["headers"]["task"] == "kvbatch.index_run"
    env = {k: v for k, v in os.environ.items() if k != "KVBATCH_BROKER_URL"}
    procs = [
        _process(tmp_path, "index-worker", "index-worker", "--broker", redis_server.url,
                 "--metrics-port", "0", env=env),
        _process(tmp_path, "embedding", "worker", "--model", str(minilm), "--broker",
                 redis_server.url, "--queue", model_queue(str(minilm)), "--device", "cpu",
                 "--metrics-port", "0", env=env),
    ]  # fmt: skip
    target = run_record(spec, "docs-index", "2026-03-01")
    try:
        deadline = time.monotonic() + 180
        while "status" not in _json(target):
            logs = "\n".join(p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
            assert time.monotonic() < deadline, logs
            assert all(p.poll() is None for p in procs), logs
            time.sleep(0.2)
    finally:
        stop_processes(procs)
    record = _json(target)
    assert record["status"] == "merged" and record["sent"] is True
    rows = table_rows(spec)
    assert sorted(r["document_id"] for r in rows) == ["reefs.txt", "tides.txt"]
    assert {r["run_id"] for r in rows} == {record["run_id"]}
    assert record["report"]["chunks"] == len(rows)
    # a trigger of the same date after the run: still nothing sent
    assert start_scheduled_run(entry, day, app=app) is None
    assert redis.Redis.from_url(redis_server.url).llen(INDEX_QUEUE) == 0

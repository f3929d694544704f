"""Scheduled runs: the schedule file, runs keyed by date, beat."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.worker.schedule import ScheduleError, load_schedule, parse_schedule
from tests.redis_server import redis_server  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


def _entry(**over):
    e = {"name": "nightly", "cron": "0 2 * * *", "output": "out", "model": "m", "input": "in.jsonl"}
    e.update(over)
    return {k: v for k, v in e.items() if v is not None}


def test_shipped_schedules_parse():
    """Both shipped schedules index documents (an `index` entry), and their specs parse."""
    from kvbatch.index.spec import load_spec
    from kvbatch.worker.schedule import IndexEntry

    for path in ("deploy/schedules/nightly.toml", "examples/schedule.toml"):
        s = load_schedule(ROOT / path)
        assert s.timezone == "UTC"
        (job,) = s.jobs
        assert isinstance(job, IndexEntry)
    example = load_schedule(ROOT / "examples/schedule.toml").jobs[0]
    assert load_spec(ROOT / example.index).source.uri.endswith("examples/docs")


def test_the_removed_documents_mode_names_the_index_form():
    entry = {**_entry(input=None), "documents": {"prefix": "docs/"}}
    with pytest.raises(ScheduleError, match=r"job 'nightly'.*`documents` entries were removed"):
        parse_schedule({"jobs": [entry]})


def _write_chat_input(path: Path, n: int) -> Path:
    """A JSONL of `n` chat lines that share a long system prompt (more than one shard)."""
    system = (ROOT / "examples/docs/tides.txt").read_text()
    with path.open("w") as f:
        for i in range(n):
            line = {"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": f"Question {i}?"}],
                             "max_tokens": 4}}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return path


def test_bad_cron_names_entry_and_field():
    with pytest.raises(ScheduleError, match=r"job 'nightly': cron: .*expected 5"):
        parse_schedule({"jobs": [_entry(cron="0 2 * *")]})
    with pytest.raises(ScheduleError, match=r"job 'nightly': cron:"):
        parse_schedule({"jobs": [_entry(cron="99 2 * * *")]})


def test_missing_and_unknown_fields():
    with pytest.raises(ScheduleError, match=r"job 'nightly': output: missing"):
        parse_schedule({"jobs": [_entry(output=None)]})
    with pytest.raises(ScheduleError, match=r"job #1: name: missing"):
        parse_schedule({"jobs": [_entry(name=None)]})
    with pytest.raises(ScheduleError, match=r"job 'nightly': modle: unknown field"):
        parse_schedule({"jobs": [_entry(modle="x")]})
    with pytest.raises(ScheduleError, match=r"job 'nightly': input: missing"):
        parse_schedule({"jobs": [_entry(input=None)]})
    with pytest.raises(ScheduleError, match=r"job 'a b': name: .*not allowed"):
        parse_schedule({"jobs": [_entry(name="a b")]})
    with pytest.raises(ScheduleError, match=r"two jobs are named"):
        parse_schedule({"jobs": [_entry(), _entry()]})


def test_toml_file_errors(tmp_path):
    bad = tmp_path / "s.toml"
    bad.write_text("[[jobs]\n")
    with pytest.raises(ScheduleError, match="not valid TOML"):
        load_schedule(bad)
    with pytest.raises(ScheduleError, match="cannot read"):
        load_schedule(tmp_path / "missing.toml")
    yml = tmp_path / "s.yaml"
    yml.write_text("timezone: Europe/Paris\njobs:\n  - name: n\n    cron: '*/5 * * * *'\n"
                   "    output: o\n    model: m\n    input: i.jsonl\n")  # fmt: skip
    assert load_schedule(yml).timezone == "Europe/Paris"


def test_same_date_twice_is_one_job(tmp_path, redis_server, tiny_chat_model):  # noqa: F811
    import redis

    from kvbatch.worker.app import DEFAULT_QUEUE, make_app
    from kvbatch.worker.scheduled import start_scheduled_run

    source = _write_chat_input(tmp_path / "in.jsonl", 6)
    out = tmp_path / "out"
    entry = parse_schedule(
        {"jobs": [_entry(
            name="rag", output=str(out), model=str(tiny_chat_model), input=str(source),
            shard_tokens=300,
        )]}
    ).jobs[0]  # fmt: skip
    app = make_app(redis_server.url)
    day = dt.date(2025, 3, 1)
    assert start_scheduled_run(entry, day, app=app) == "rag-2025-03-01"
    assert start_scheduled_run(entry, day, app=app) is None  # duplicate trigger: no-op
    manifest = json.loads((out / "rag-2025-03-01" / "job.json").read_text())
    queued = redis.Redis.from_url(redis_server.url).llen(DEFAULT_QUEUE)
    assert queued == len(manifest["shards"]) >= 1  # one message per shard, sent once
    assert manifest["num_requests"] == 6
    assert sorted(p.name for p in out.iterdir()) == ["rag-2025-03-01", "runs"]
    # the next day is another run of the same input
    assert start_scheduled_run(entry, dt.date(2025, 3, 2), app=app) == "rag-2025-03-02"


def test_cron_entries_become_crontabs():
    from celery import Celery
    from celery.schedules import crontab

    from kvbatch.worker.scheduled import SCHEDULED_QUEUE, SCHEDULED_TASK, register_scheduled

    schedule = parse_schedule(
        {"timezone": "Europe/Paris",
         "jobs": [_entry(), _entry(name="hourly", cron="15 * * * 1-5")]}
    )  # fmt: skip
    app = Celery("t", set_as_current=False)
    register_scheduled(app, schedule)
    assert SCHEDULED_TASK in app.tasks
    assert app.conf.timezone == "Europe/Paris"
    beat = app.conf.beat_schedule
    assert set(beat) == {"kvbatch-nightly", "kvbatch-hourly"}
    assert beat["kvbatch-nightly"]["schedule"] == crontab(minute="0", hour="2")
    assert beat["kvbatch-hourly"]["schedule"] == crontab(minute="15", day_of_week="1-5")
    assert beat["kvbatch-hourly"]["args"] == ("hourly",)
    assert beat["kvbatch-hourly"]["options"]["queue"] == SCHEDULED_QUEUE


def test_beat_help_starts():
    r = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", "beat", "--help"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "--schedule" in r.stdout


def test_beat_bad_schedule_fails_clearly(tmp_path, capsys):
    from kvbatch.cli import main

    bad = tmp_path / "s.toml"
    bad.write_text('[[jobs]]\nname = "x"\ncron = "bad"\n')
    assert main(["beat", "--schedule", str(bad), "--broker", "redis://127.0.0.1:1/0"]) == 1
    err = capsys.readouterr().err
    assert "job 'x': cron" in err and "output: missing" in err


def test_a_run_whose_sends_failed_is_sent_by_the_next_trigger(
    tmp_path,
    redis_server,  # noqa: F811
    tiny_chat_model,
):
    """The broker goes away while a run's shards are sent: job.json is written, the run
    record says not sent; the next trigger of that date sends the shards, once."""
    import redis
    from kombu.exceptions import OperationalError

    from kvbatch.worker.app import DEFAULT_QUEUE, make_app
    from kvbatch.worker.scheduled import start_scheduled_run

    source = _write_chat_input(tmp_path / "in.jsonl", 6)
    out = tmp_path / "out"
    entry = parse_schedule(
        {"jobs": [_entry(
            name="rag", output=str(out), model=str(tiny_chat_model), input=str(source),
            shard_tokens=300,
        )]}
    ).jobs[0]  # fmt: skip
    day = dt.date(2025, 4, 1)
    dead = make_app("redis://127.0.0.1:1/0")  # nothing listens there
    dead.conf.broker_connection_max_retries = 1
    dead.conf.task_publish_retry = False
    dead.conf.task_ignore_result = True
    with pytest.raises(OperationalError):
        start_scheduled_run(entry, day, app=dead)
    assert (out / "rag-2025-04-01" / "job.json").exists()
    assert json.loads((out / "runs" / "rag-2025-04-01.json").read_text())["sent"] is False
    app = make_app(redis_server.url)
    assert start_scheduled_run(entry, day, app=app) == "rag-2025-04-01"  # sent now
    assert start_scheduled_run(entry, day, app=app) is None  # and only once
    manifest = json.loads((out / "rag-2025-04-01" / "job.json").read_text())
    queued = redis.Redis.from_url(redis_server.url).llen(DEFAULT_QUEUE)
    assert queued == len(manifest["shards"]) >= 1
    record = json.loads((out / "runs" / "rag-2025-04-01.json").read_text())
    assert record["sent"] is True and record["requests"] == 6


def test_a_relative_output_reaches_the_workers_as_an_absolute_path(
    tmp_path,
    redis_server,  # noqa: F811
    tiny_chat_model,
    monkeypatch,
):
    """`output = "out/scheduled"` named beat's folder in the job and another folder (the
    worker's) in the messages: the job never ran and the next trigger did nothing."""
    import base64

    import redis

    from kvbatch.worker.app import DEFAULT_QUEUE, make_app
    from kvbatch.worker.scheduled import start_scheduled_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]}}) + "\n"
    )  # fmt: skip
    entry = parse_schedule(
        {"jobs": [_entry(name="rel", output="out/scheduled", model=str(tiny_chat_model))]}
    ).jobs[0]
    assert start_scheduled_run(entry, dt.date(2025, 3, 1), app=make_app(redis_server.url))
    folder = tmp_path / "out" / "scheduled" / "rel-2025-03-01"
    manifest = json.loads((folder / "job.json").read_text())
    assert [s["uri"] for s in manifest["shards"]] == [str(folder / "shards/shard-00000.jsonl")]
    (raw,) = redis.Redis.from_url(redis_server.url).lrange(DEFAULT_QUEUE, 0, -1)
    _, kwargs, _ = json.loads(base64.b64decode(json.loads(raw)["body"]))
    assert kwargs["output"] == str(tmp_path / "out" / "scheduled")
    assert kwargs["shard"]["uri"] == manifest["shards"][0]["uri"]

"""`celery -A kvbatch.worker.celery_app`: Celery's own command line against a real worker on a
real redis-server, and the environment switches of the module-level app."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbatch.broker.settings import BrokerError, task_events
from kvbatch.worker.app import make_app
from tests.redis_server import redis_server  # noqa: F401

CELERY = [sys.executable, "-m", "celery", "-A", "kvbatch.worker.celery_app"]


def test_task_events_follow_the_environment(monkeypatch):
    monkeypatch.delenv("KVBATCH_TASK_EVENTS", raising=False)
    assert task_events() is False
    assert make_app("redis://127.0.0.1:1/0").conf.worker_send_task_events is False
    monkeypatch.setenv("KVBATCH_TASK_EVENTS", "1")
    app = make_app("redis://127.0.0.1:1/0")
    assert app.conf.worker_send_task_events is True and app.conf.task_send_sent_event is True
    assert make_app("redis://127.0.0.1:1/0", events=False).conf.worker_send_task_events is False
    monkeypatch.setenv("KVBATCH_TASK_EVENTS", "maybe")
    with pytest.raises(BrokerError, match="KVBATCH_TASK_EVENTS='maybe'"):
        task_events()


def test_the_module_app_reads_the_broker_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVBATCH_BROKER_URL", "redis://127.0.0.1:7/3")
    monkeypatch.setenv("KVBATCH_VISIBILITY_TIMEOUT", "321")
    module = importlib.import_module("kvbatch.worker.celery_app")
    module = importlib.reload(module)
    assert module.app.conf.broker_url == "redis://127.0.0.1:7/3"
    assert module.app.conf.broker_transport_options["visibility_timeout"] == 321
    monkeypatch.delenv("KVBATCH_BROKER_URL")
    with pytest.raises(BrokerError, match="set KVBATCH_BROKER_URL"):
        importlib.reload(module)


def test_celery_inspect_ping_reaches_a_real_worker(redis_server, tmp_path: Path):  # noqa: F811
    env = {**os.environ, "KVBATCH_BROKER_URL": redis_server.url, "KVBATCH_TASK_EVENTS": "1"}
    name = "kvbatch-ping@localhost"
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [*CELERY, "worker", "--pool=solo", "-n", name, "-Q", "kvbatch", "--loglevel=INFO"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            ping = subprocess.run(
                [*CELERY, "inspect", "ping", "-d", name, "--timeout", "3"],
                env=env,
                capture_output=True,
                text=True,
            )
            if "pong" in ping.stdout or time.monotonic() > deadline or worker.poll() is not None:
                break
            time.sleep(1)
        assert "pong" in ping.stdout, (
            ping.stdout,
            ping.stderr,
            (tmp_path / "worker.log").read_text(),
        )
        conf = subprocess.run(
            [*CELERY, "inspect", "conf", "-d", name, "--timeout", "5"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert '"worker_send_task_events": true' in conf.stdout, conf.stdout
    finally:
        worker.terminate()  # warm shutdown of the worker this test started
        worker.wait(timeout=30)
        log.close()

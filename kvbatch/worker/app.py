"""The workers' Celery app: the broker's app (broker/app.py says why each setting) with the
shard task registered, and the one-process worker loop."""

from __future__ import annotations

from celery import Celery

from kvbatch.broker.app import celery_app
from kvbatch.broker.settings import (
    DEFAULT_QUEUE,
    TASK_NAME,
    BrokerError,
    broker_url,
    task_events,
    visibility_timeout,
)
from kvbatch.worker.tasks import register

__all__ = [
    "DEFAULT_QUEUE",
    "TASK_NAME",
    "BrokerError",
    "broker_url",
    "make_app",
    "task_events",
    "visibility_timeout",
]


def make_app(broker: str, *, visibility: int | None = None, events: bool | None = None) -> Celery:
    """A Celery app on `broker` with the shard task registered."""
    app = celery_app(broker, visibility=visibility, events=events)
    register(app)
    return app


def run_solo_worker(app: Celery, queue: str, loglevel: str, name: str) -> None:
    """Run `app` as a one-process worker on `queue` until it is stopped: one task at a time
    (a worker holds one model, and a GPU runs one shard), no gossip, mingle or heartbeat
    (workers never need each other)."""
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            f"--loglevel={loglevel}",
            "-Q",
            queue,
            "-n",
            name,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )

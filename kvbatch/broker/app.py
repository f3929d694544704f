"""The Celery app, configured for long GPU tasks (one shard = one task, minutes long), as the
workers, `kvbatch submit` and `kvbatch index --broker` all use it; the worker registers the shard
task on it (worker/app.py).

Why each setting (docs/DISTRIBUTED.md, "Guarantees", tells the whole story):

- JSON only: a message is data (a shard pointer); no serializer that can carry code is accepted.
- acks_late + prefetch 1: a worker acknowledges a shard only when it is done and holds no
  other shard meanwhile, so a dead worker's shard goes back to the queue, not to a neighbour's
  prefetch buffer.
- reject_on_worker_lost: a shard whose worker died is requeued, not acknowledged and lost.
  Redeliveries are then unbounded, so the task counts attempts itself (kvbatch.jobs.distributed.finalize).
- visibility_timeout above the longest shard: on Redis and SQS an unacknowledged message is
  handed out again once it expires, even while its first worker still runs it.
- cancel long-running tasks on connection loss: else an acks_late shard can run twice after
  a broker reconnect. Reconnect forever (a broker restart must not end a worker), and retry
  storing results while Redis is away.
- The solo pool (worker/cli.py) runs shards in the worker's own process: no fork, so CUDA is
  never initialised in a parent that forks, and the model is loaded once per process.
"""

from __future__ import annotations

import os

from celery import Celery

from kvbatch.broker.settings import (
    DEFAULT_QUEUE,
    SCHEMES,
    BrokerError,
    redact_url,
    task_events,
    visibility_timeout,
)


def celery_app(broker: str, *, visibility: int | None = None, events: bool | None = None) -> Celery:
    """A Celery app on `broker`, configured as every kvbatch process needs it (no task
    registered: a sender names the task, a worker registers it). `events`: send task events
    (for `celery events` and Flower); None reads KVBATCH_TASK_EVENTS (off by default)."""
    if not broker.startswith(SCHEMES):
        raise BrokerError(
            f"broker URL {redact_url(broker)!r}: expected one of {', '.join(SCHEMES)}"
        )
    vt = visibility if visibility is not None else visibility_timeout()
    send_events = task_events() if events is None else events
    app = Celery("kvbatch", broker=broker, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        worker_pool="solo",
        worker_cancel_long_running_tasks_on_connection_loss=True,
        broker_connection_retry_on_startup=True,
        # A broker restart must not end a worker: reconnect for as long as it takes.
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        task_default_queue=DEFAULT_QUEUE,
        task_create_missing_queues=True,
        # Task events cost a broker message per task state change: cheap next to a
        # minutes-long shard, and what Flower and `celery events` show.
        worker_send_task_events=send_events,
        task_send_sent_event=send_events,
        broker_transport_options=_transport_options(broker, vt),
    )
    if broker.startswith(("redis://", "rediss://")):
        # Results (a shard's line count) are small and optional; on Redis they live beside
        # the queue, with the same visibility timeout (Celery reads both settings).
        app.conf.update(
            result_backend=broker,
            result_backend_transport_options={"visibility_timeout": vt},
            result_expires=24 * 3600,
            # Storing a result while Redis restarts is retried, not a failed task.
            result_backend_always_retry=True,
            result_backend_max_retries=20,
        )
    else:
        app.conf.update(task_ignore_result=True)  # SQS has no result backend
    return app


def _transport_options(broker: str, vt: int) -> dict:
    options: dict = {"visibility_timeout": vt}
    if broker.startswith(("redis://", "rediss://")):
        # kombu sweeps for expired unacknowledged messages every interval x throttle seconds
        # (10 x 10 by default): sweep every quarter of the timeout, at most once a minute, so
        # a dead worker's shard comes back soon after its visibility timeout ends.
        options["unacked_restore_interval"] = max(1, min(60, vt // 4))
        options["unacked_restore_throttle"] = 1
    if broker.startswith("sqs://"):
        options["region"] = (
            os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        )
        # Optional: a queue made beforehand (with its dead-letter queue) instead of one that
        # kombu creates on first use.
        queue_url = os.environ.get("KVBATCH_SQS_QUEUE_URL")
        if queue_url:
            options["predefined_queues"] = {DEFAULT_QUEUE: {"url": queue_url}}
    return options

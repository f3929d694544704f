"""Sending one shard's pointer message to a queue."""

from __future__ import annotations

from celery import Celery

from kvbatch.broker.settings import TASK_NAME
from kvbatch.jobs.distributed.shards import ShardMessage


def send_shard(app: Celery, output: str, message: ShardMessage, queue: str) -> None:
    """Enqueue one shard for the job under `output`: the task is named, not imported, so a
    sender needs no worker code (the message is JSON: the job's folder and the shard's pointer)."""
    app.send_task(
        TASK_NAME,
        kwargs={"output": output, "shard": message.to_dict()},
        queue=queue,
        # as the registered task would: results kept where the app keeps them (Redis)
        ignore_result=app.conf.task_ignore_result,
    )

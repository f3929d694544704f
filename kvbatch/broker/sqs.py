"""SQS specifics: the queue with its dead-letter queue, and the visibility heartbeat.

kombu's SQS transport never extends a message's visibility by itself (docs/DISTRIBUTED.md): a
shard that runs longer than the queue's visibility timeout is handed to a second worker while
the first still runs it. `visibility_heartbeat` runs a thread beside the shard that calls
ChangeMessageVisibility every third of the timeout, setting it back to the full timeout, until
the task ends. SQS caps a message's visibility at 12 h after it was received; past that the
heartbeat stops and says so.

`ensure_queue` creates the queue (when kvbatch is the one creating it) with a RedrivePolicy to
`<queue>-dlq`. maxReceiveCount is above any shard's attempt cap: the attempt markers give up on
a shard first (its lines become error records); the dead-letter queue catches only messages
that never reach the task body (undecodable, a worker that dies before the first marker, ...).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("kvbatch.worker")

SQS_MAX_VISIBILITY = 12 * 3600  # SQS: at most 12 h after the message was received
DLQ_SUFFIX = "-dlq"
# Above --max-attempts (default 3): our attempt counter gives up first. KVBATCH_SQS_MAX_RECEIVES
# changes it; 0 makes queues without a dead-letter queue.
DEFAULT_MAX_RECEIVES = 10
DLQ_RETENTION = 14 * 24 * 3600  # SQS's longest: time to look at what landed there


def max_receives() -> int:
    raw = os.environ.get("KVBATCH_SQS_MAX_RECEIVES", str(DEFAULT_MAX_RECEIVES))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"KVBATCH_SQS_MAX_RECEIVES={raw!r}: expected a whole number") from None
    if value < 0:
        raise ValueError(f"KVBATCH_SQS_MAX_RECEIVES={raw!r}: must be 0 (no DLQ) or more")
    return value


def is_sqs(app) -> bool:
    return str(app.conf.broker_url or "").startswith("sqs://")


_channels: dict[int, Any] = {}  # id(app) -> kombu SQS channel, one per app and process
_channels_lock = threading.Lock()


def _channel_client(app, queue: str | None = None) -> tuple[Any, Any]:
    """kombu's own SQS channel and boto3 client for `app` (same endpoint, credentials and
    region as the worker's consumer). One connection per app, kept for the process."""
    with _channels_lock:
        channel = _channels.get(id(app))
        if channel is None:
            channel = _channels[id(app)] = app.connection_for_write().default_channel
    predefined = queue is not None and queue in channel.predefined_queues
    return channel, channel.sqs(queue=queue if predefined else None)


def ensure_queue(app, queue: str, *, receives: int | None = None) -> str | None:
    """Create the SQS queue `queue` with a dead-letter queue `<queue>-dlq` (RedrivePolicy,
    maxReceiveCount `receives`) unless it exists; its URL. A queue that exists is left as it
    is (a warning if it has no redrive policy); a predefined queue (KVBATCH_SQS_QUEUE_URL) is
    never touched. No-op (None) on other brokers."""
    if not is_sqs(app):
        return None
    receives = max_receives() if receives is None else receives
    channel, client = _channel_client(app, queue)
    if queue in channel.predefined_queues:
        return channel.predefined_queues[queue]["url"]
    name = channel.canonical_queue_name(queue)
    vt = str(channel.visibility_timeout)
    try:
        url = client.get_queue_url(QueueName=name)["QueueUrl"]
    except client.exceptions.QueueDoesNotExist:
        url = None
    if url is not None:
        attrs = client.get_queue_attributes(QueueUrl=url, AttributeNames=["RedrivePolicy"])
        if receives and "RedrivePolicy" not in attrs.get("Attributes", {}):
            log.warning(
                "SQS queue %s has no dead-letter queue (RedrivePolicy): messages that never "
                "reach a shard's task are retried forever; see docs/DISTRIBUTED.md",
                name,
            )
        return url
    attributes = {"VisibilityTimeout": vt}
    if receives:
        dlq = client.create_queue(
            QueueName=name + DLQ_SUFFIX,
            Attributes={"MessageRetentionPeriod": str(DLQ_RETENTION)},
        )["QueueUrl"]
        arn = client.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])
        policy = {
            "deadLetterTargetArn": arn["Attributes"]["QueueArn"],
            "maxReceiveCount": str(receives),
        }
        attributes["RedrivePolicy"] = json.dumps(policy)
    url = client.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    log.info("created SQS queue %s (dead-letter queue: %s)", name,
             name + DLQ_SUFFIX if receives else "none")  # fmt: skip
    return url


class VisibilityHeartbeat:
    """A thread that keeps one SQS message invisible while its shard runs.

    Every `timeout / 3` seconds it sets the message's visibility back to `timeout` (never
    past SQS's 12 h from `received`). A failed call is logged and tried again at the next
    beat: two missed beats in a row still leave a third of the timeout."""

    def __init__(self, client, queue_url: str, receipt: str, timeout: int, received: float):
        self.client, self.queue_url, self.receipt = client, queue_url, receipt
        self.timeout, self.received = timeout, received
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sqs-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        interval = max(1.0, self.timeout / 3)
        while not self._stop.wait(interval):
            left = SQS_MAX_VISIBILITY - (time.time() - self.received) - interval
            extend = int(min(self.timeout, left))
            if extend <= 0:
                log.warning(
                    "SQS heartbeat: the message reached SQS's 12 h visibility cap; if the "
                    "shard is still running it will be delivered again"
                )
                return
            try:
                self.client.change_message_visibility(
                    QueueUrl=self.queue_url, ReceiptHandle=self.receipt, VisibilityTimeout=extend
                )
                self.beats += 1
            except Exception as e:  # botocore errors; the shard goes on either way
                code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
                log.warning("SQS heartbeat: ChangeMessageVisibility failed: %s", e)
                if code in ("ReceiptHandleIsInvalid", "MessageNotInflight"):
                    return  # the message is gone or visible again: nothing left to extend


@contextmanager
def visibility_heartbeat(task) -> Iterator[VisibilityHeartbeat | None]:
    """Keep the SQS message of `task`'s request invisible until the block ends; does nothing
    on Redis (or when the request carries no SQS message, e.g. an eager call).

    kombu puts the received message and its queue URL in the message's properties
    (delivery_info: sqs_message, sqs_queue); Celery keeps them in request.properties."""
    properties = getattr(getattr(task, "request", None), "properties", None) or {}
    info = properties.get("delivery_info") or {}
    message, queue_url = info.get("sqs_message"), info.get("sqs_queue")
    if not message or not queue_url or not is_sqs(task.app):
        yield None
        return
    options = task.app.conf.broker_transport_options or {}
    timeout = int(options.get("visibility_timeout") or 1800)
    try:
        _, client = _channel_client(task.app, info.get("routing_key"))
    except Exception as e:
        log.warning("SQS heartbeat: no client (%s); the shard runs without one", e)
        yield None
        return
    heartbeat = VisibilityHeartbeat(client, queue_url, message["ReceiptHandle"], timeout,
                                    received=time.time())  # fmt: skip
    heartbeat.start()
    try:
        yield heartbeat
    finally:
        heartbeat.stop()
        if heartbeat.beats:
            log.info("SQS heartbeat: extended the message's visibility %d times (to %d s)",
                     heartbeat.beats, timeout)  # fmt: skip

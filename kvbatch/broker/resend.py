"""`kvbatch resend`: send again the shards of a job that the broker lost.

Why a shard can be lost on Redis: kombu's consumer takes a message with BRPOP, which removes
it from the queue list, and only then records it in the `unacked` hash. A broker that dies in
between (or a reply lost with its connection) leaves the message in neither place: no worker
ever runs the shard and the job never completes. The window is a few milliseconds per
delivery, but a Redis restart while workers are taking shards can hit it (one shard per worker
at most: each has one BRPOP in flight).

A shard is lost when it has no result and the broker holds no message for it, neither waiting
in the queue (every priority list) nor delivered and unacknowledged. The broker is read twice,
`settle` seconds apart, each time in one MULTI so the lists and the hash are one snapshot: a
message caught between BRPOP and its unacked record in the first read is in the hash by the
second. Results are listed after the broker (a worker writes its result before it
acknowledges), so a shard acknowledged between the reads still counts as written.

Sending a shard twice is safe: results are written once (first writer wins), and a delivery
that finds the result does nothing (worker/tasks.py). SQS cannot be listed and does not lose
received messages (an unacknowledged one comes back after its visibility timeout), so there
only `unwritten=True` (every shard without a result) applies.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvbatch.broker.settings import TASK_NAME
from kvbatch.jobs.distributed.shards import ShardMessage
from kvbatch.jobs.storage import Storage

log = logging.getLogger("kvbatch.worker")


class ResendError(ValueError):
    """The job cannot be checked or resent as asked."""


@dataclass(frozen=True)
class ResendResult:
    shards: int  # in the job
    written: int  # with a result
    resent: list[str]  # shard ids sent again


def unwritten_shards(
    job: Storage, manifest: dict, skip: set[str] = frozenset()
) -> list[ShardMessage]:
    """The messages of the job's shards that have no result, leaving out the ids in `skip`."""
    done = {k.split("/", 1)[1].removesuffix(".jsonl") for k in job.list("results/")}
    leave_out = done | set(skip)
    return [
        ShardMessage(manifest["job_id"], s["shard_id"], s["uri"], s["sha256"])
        for s in manifest["shards"]
        if s["shard_id"] not in leave_out
    ]


def held_shards(app, queue: str, job_id: str) -> set[str]:
    """Shard ids of `job_id` that the Redis broker holds a message for: waiting in `queue`
    (any priority) or delivered and not yet acknowledged (any queue)."""
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        # kombu's own key names: the list per priority step and the unacked hash
        lists = [channel._q_for_pri(queue, pri) for pri in channel.priority_steps]
        with channel.client.pipeline(transaction=True) as pipe:
            for key in dict.fromkeys(lists):
                pipe.lrange(key, 0, -1)
            pipe.hvals(channel.unacked_key)
            *waiting, unacked = pipe.execute()
        payloads = [raw for items in waiting for raw in items]
        payloads += [_unacked_payload(raw) for raw in unacked]
        held = set()
        for raw in payloads:
            shard = _shard_of(channel, raw)
            if shard is not None and shard.job_id == job_id:
                held.add(shard.shard_id)
        return held


def _unacked_payload(raw: bytes) -> dict | None:
    """kombu stores an unacknowledged delivery as JSON [message, exchange, routing_key]."""
    from kombu.utils.json import loads

    try:
        return loads(raw)[0]
    except (ValueError, TypeError, IndexError, KeyError):
        return None


def _shard_of(channel, raw) -> ShardMessage | None:
    """The shard a broker message carries, or None for anything else (another task, a
    message that does not decode)."""
    from kombu.utils.json import loads

    try:
        payload = loads(raw) if isinstance(raw, (bytes, str)) else raw
        if payload.get("headers", {}).get("task") != TASK_NAME:
            return None
        _args, kwargs, _embed = channel.message_to_python(payload).decode()
        return ShardMessage.from_dict(kwargs["shard"])
    except Exception:  # a foreign or damaged message is not ours to judge
        return None


def lost_shards(
    app, queue: str, job: Storage, manifest: dict, *, settle: float = 2.0
) -> list[ShardMessage]:
    """Shards with no result that the broker held no message for in either of two reads
    `settle` seconds apart (see the module docstring)."""
    first = held_shards(app, queue, manifest["job_id"])
    time.sleep(settle)
    second = held_shards(app, queue, manifest["job_id"])
    return unwritten_shards(job, manifest, skip=first | second)


def resend(
    app, queue: str, output: str, job: Storage, manifest: dict, *, unwritten: bool = False,
    settle: float = 2.0,
) -> ResendResult:  # fmt: skip
    """Send again the shards that are lost (Redis), or with `unwritten` every shard that has
    no result (any broker). Returns what was sent."""
    from kvbatch.broker.send import send_shard

    redis = app.conf.broker_url.startswith(("redis://", "rediss://"))
    if not (redis or unwritten):
        raise ResendError(
            "this broker's queue cannot be listed (SQS keeps a received message and hands it "
            "out again after its visibility timeout, so it does not lose shards); to send "
            "every shard that has no result again, add --unwritten"
        )
    if unwritten:
        messages = unwritten_shards(job, manifest)
    else:
        messages = lost_shards(app, queue, job, manifest, settle=settle)
    for msg in messages:
        send_shard(app, output, msg, queue)
    if messages:
        log.warning(
            "job %s: sent %d shards again: %s",
            manifest["job_id"], len(messages), ", ".join(m.shard_id for m in messages),
        )  # fmt: skip
    written = len(manifest["shards"]) - len(unwritten_shards(job, manifest))
    return ResendResult(len(manifest["shards"]), written, [m.shard_id for m in messages])

"""Which shards are running now: a heartbeat file per running shard.

    <job>/running/<shard_id>.json   {"owner": worker, "at": time}, rewritten every `every`
                                    seconds while the shard runs, removed when it stops

A queue hands a message out again once its visibility timeout passes, even while the first
worker still runs it (Redis; SQS too if the heartbeat that extends the visibility fails). Such
a delivery must not claim an attempt: with three or more workers, redeliveries of one long
shard would use up its attempts and turn its good answers into shard_failed. A delivery that
finds a fresh heartbeat waits instead (the worker sends it again later); one that finds a
stale heartbeat (its runner was killed) claims the next attempt as usual.

Heartbeats compare the writer's clock with the reader's: workers' clocks must agree to well
within `stale_after` (NTP does).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvbatch.jobs.storage import Storage, StorageError, validate_key_part

DEFAULT_EVERY = 10.0  # seconds between heartbeats (KVBATCH_RUNNING_HEARTBEAT)


def heartbeat_every() -> float:
    raw = os.environ.get("KVBATCH_RUNNING_HEARTBEAT")
    if raw is None:
        return DEFAULT_EVERY
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"KVBATCH_RUNNING_HEARTBEAT={raw!r}: expected seconds") from None
    if value <= 0:
        raise ValueError(f"KVBATCH_RUNNING_HEARTBEAT={raw!r}: must be positive")
    return value


def _marker(job: Storage, shard_id: str) -> Storage:
    return job.join("running", f"{validate_key_part(shard_id)}.json")


def running_elsewhere(job: Storage, shard_id: str, *, every: float | None = None) -> str | None:
    """The owner of a fresh heartbeat of `shard_id` (it runs now, elsewhere), or None."""
    every = heartbeat_every() if every is None else every
    try:
        with _marker(job, shard_id).open_read() as f:
            beat = json.loads(f.read())
        at, owner = float(beat["at"]), str(beat["owner"])
    except (StorageError, ValueError, KeyError, TypeError):
        return None
    return owner if time.time() - at < 3 * every else None


@contextmanager
def running(
    job: Storage, shard_id: str, owner: str, *, every: float | None = None
) -> Iterator[None]:
    """Beat for `shard_id` while the block runs; the marker is removed when it ends."""
    every = heartbeat_every() if every is None else every
    marker = _marker(job, shard_id)
    stop = threading.Event()

    def beat() -> None:
        payload = json.dumps({"owner": owner, "at": time.time()}).encode()
        try:
            marker.write_bytes(payload)
        except StorageError:
            pass  # a missed beat; three in a row make the shard look stale

    beat()

    def loop() -> None:
        while not stop.wait(every):
            beat()

    thread = threading.Thread(target=loop, daemon=True, name=f"running-{shard_id}")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        try:
            marker.delete()
        except StorageError:
            pass  # goes stale by itself

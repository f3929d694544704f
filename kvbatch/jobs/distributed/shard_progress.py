"""How far a running shard is, before its result is written (`kvbatch run`'s own progress
bar is jobs/local/progress.py).

A shard's result appears only when the whole shard is done, and shards default to ~200k
prompt tokens, so `kvbatch status` would show 0 requests and no ETA for a long while. The
worker therefore writes a small progress object now and then while a shard runs:

    <job>/progress/<shard_id>.json   {"finished": requests done, "output_tokens": n, "at": unix s}

counted from the engine's own totals since the shard started. job_status adds these up for
the shards that have no result yet (a written result replaces its shard's progress). Writing
progress never fails a shard: an error is logged and the shard goes on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

from kvbatch.jobs.storage import Storage, StorageError

log = logging.getLogger(__name__)

EVERY_S = 10.0  # seconds between two progress writes of one shard


def progress_key(shard_id: str) -> tuple[str, str]:
    return ("progress", f"{shard_id}.json")


class ProgressWriter:
    """`should_stop` for run_shard that writes the shard's progress at most once every
    `every` seconds, then asks the wrapped check (the cancel check, the metrics observer)."""

    def __init__(
        self,
        job: Storage,
        shard_id: str,
        llm,
        should_stop: Callable[[], bool] | None = None,
        *,
        every: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.target = job.join(*progress_key(shard_id))
        self.llm, self.should_stop, self.every, self.clock = llm, should_stop, every, clock
        start = llm.stats()  # the engine is the worker's, reused across shards
        self._base = (start.num_finished, start.generation_tokens)
        self._next = clock() + every

    def __call__(self) -> bool:
        now = self.clock()
        if now >= self._next:
            self._next = now + self.every
            self.write()
        return bool(self.should_stop()) if self.should_stop is not None else False

    def write(self) -> None:
        stats = self.llm.stats()
        progress = {
            "finished": stats.num_finished - self._base[0],
            "output_tokens": stats.generation_tokens - self._base[1],
            "at": round(time.time(), 1),
        }
        try:
            self.target.write_bytes(json.dumps(progress).encode())
        except Exception as e:  # progress is a convenience: the shard goes on
            log.warning("cannot write progress %s: %s", self.target.uri, e)


def running_progress(job: Storage, shard_ids: Iterable[str]) -> dict:
    """The summed progress of these shards (those without a result): requests finished and
    output tokens so far; shards that wrote none count 0."""
    total = {"finished": 0, "output_tokens": 0}
    for shard_id in shard_ids:
        try:
            with job.join(*progress_key(shard_id)).open_read() as f:
                progress = json.loads(f.read())
        except (StorageError, ValueError):
            continue
        total["finished"] += int(progress.get("finished", 0))
        total["output_tokens"] += int(progress.get("output_tokens", 0))
    return total

"""Cancelling a distributed job: a marker in storage that workers look for.

    <job>/cancel   {"at": time}, written once by `kvbatch cancel` (write_if_absent)

What a cancel does to each shard (as with OpenAI's cancelled batches, finished lines are kept
and every line is accounted for exactly once):

    result already written      kept as it is
    pending (no attempt yet)    `kvbatch cancel` writes its result: every line batch_cancelled
    delivered after the cancel  the worker writes that same result instead of running it
    running                     the worker sees the marker between engine steps (CancelCheck),
                                aborts the shard's requests, keeps the lines that finished; the
                                rest become batch_cancelled

A shard result is written once (first writer wins), so a worker and `kvbatch cancel` racing
on a shard agree on one result. try_finalize then writes status "cancelled" (finalize.json
records whether the marker was there when the job was claimed for finalizing: a cancel that
comes after that changes nothing).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvbatch.jobs.distributed.cancelled import CANCEL_MARKER, cancel_requested
from kvbatch.jobs.distributed.finalize import cancel_shard, read_manifest, try_finalize
from kvbatch.jobs.distributed.shards import ShardMessage
from kvbatch.jobs.storage import Storage, StorageError

__all__ = ["CancelCheck", "CancelResult", "cancel_job", "cancel_requested"]


@dataclass(frozen=True)
class CancelResult:
    """What `cancel_job` found and did."""

    status: str  # the job's status afterwards: cancelling, cancelled or completed
    changed: bool  # False: already cancelled/cancelling, or finished before the cancel
    skipped_shards: int  # pending shards written as batch_cancelled here


def cancel_job(job: Storage) -> CancelResult:
    """Ask a job to stop: write the marker, mark batch.json "cancelling", write the pending
    shards' results as cancelled, and finalize if nothing is left running. Idempotent."""
    manifest = read_manifest(job)  # a damaged one stops the cancel before it changes anything
    marker = job.join(CANCEL_MARKER)
    finished = _finalized(job)
    if finished is not None:  # finalized before this cancel: nothing to change
        return CancelResult(finished, False, 0)
    changed = marker.write_if_absent(json.dumps({"at": int(time.time())}).encode())
    if changed:
        _mark_cancelling(job)
    skipped = 0
    attempted = {key.split("/", 1)[1].rsplit(".", 1)[0] for key in job.list("attempts/")}
    for shard in manifest["shards"]:
        if shard["shard_id"] in attempted:
            continue  # running (or was): its worker stops between steps
        msg = ShardMessage(manifest["job_id"], shard["shard_id"], shard["uri"], shard["sha256"])
        skipped += cancel_shard(job, msg)
    # A finalizer may have claimed the job between the checks above and our batch.json write:
    # finalizing again rewrites its final batch.json (same bytes). Else, finalize if every
    # shard is accounted for already (nothing was running).
    record = try_finalize(job)
    status = record.status if record is not None else "cancelling"
    return CancelResult(status, changed, skipped)


def _finalized(job: Storage) -> str | None:
    """The final status if the job was claimed for finalizing, else None."""
    try:
        with job.join("finalize.json").open_read() as f:
            claim = json.loads(f.read())
    except StorageError:
        return None
    return "cancelled" if claim.get("cancelled") else "completed"


def _mark_cancelling(job: Storage) -> None:
    target = job.join("batch.json")
    try:
        with target.open_read() as f:
            batch = json.loads(f.read())
    except StorageError:
        return
    if batch.get("status") in ("completed", "cancelled"):
        return
    batch["status"] = "cancelling"
    batch["cancelling_at"] = int(time.time())
    target.write_bytes(json.dumps(batch, indent=2).encode() + b"\n")


class CancelCheck:
    """`should_stop` for run_shard: is the job's cancel marker there? Storage is asked at most
    once every `every` seconds (an S3 HEAD per engine step would cost more than the step)."""

    def __init__(
        self, job: Storage, every: float = 1.0, clock: Callable[[], float] = time.monotonic
    ):
        self.job, self.every, self.clock = job, every, clock
        self._next = 0.0
        self._cancelled = False

    def __call__(self) -> bool:
        if self._cancelled:
            return True
        now = self.clock()
        if now >= self._next:
            self._next = now + self.every
            self._cancelled = cancel_requested(self.job)
        return self._cancelled

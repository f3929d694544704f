"""Why a shard waits: a worker that leaves a shard to others (its model is not the job's) notes
why, so that `kvbatch status` can say it instead of showing a job stuck in_progress.

    <job>/waits/<shard_id>.json    {"at": time, "worker": host:pid, "reason": "..."}

A note matters only until the shard is claimed: a note older than the shard's latest attempt
is stale (a matching worker took it since) and is not shown.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from kvbatch.jobs.storage import Storage, StorageError, validate_key_part

# A job whose shards no worker has taken for this long gets a hint in `kvbatch status`.
UNCLAIMED_HINT_S = 60


def note_waiting(job: Storage, shard_id: str, worker: str, reason: str) -> None:
    """Record why `worker` left the shard to others (overwrites the last note)."""
    note = {"at": time.time(), "worker": worker, "reason": reason}
    job.join("waits", f"{validate_key_part(shard_id)}.json").write_bytes(json.dumps(note).encode())


def waiting_shards(job: Storage, done: set[str]) -> dict[str, str]:
    """shard id -> why it waits, for shards with no result and no attempt since the note."""
    attempts = _latest_attempts(job)
    waits = {}
    for shard_id, note in _notes(job):
        if f"results/{shard_id}.jsonl" in done or attempts.get(shard_id, 0.0) > note["at"]:
            continue
        waits[shard_id] = f"{note['reason']} (worker {note['worker']})"
    return waits


def unclaimed_hint(job: Storage, manifest: dict, now: float) -> str | None:
    """A job none of whose shards was ever taken by a worker, UNCLAIMED_HINT_S after submit:
    what to check (a worker logs why it drops a message it cannot use)."""
    created = manifest.get("created_at")
    if not manifest.get("shards") or not isinstance(created, (int, float)):
        return None
    if now - created < UNCLAIMED_HINT_S or any(True for _ in _keys(job, "attempts/")):
        return None
    return (
        f"no worker has taken a shard in {int(now - created)} s: check that workers run on "
        f"the job's queue with its model, that they can read {job.uri} (their logs say why "
        "they drop a message), and `kvbatch resend` the shards if the broker lost them"
    )


def _notes(job: Storage) -> Iterator[tuple[str, dict]]:
    for key in _keys(job, "waits/"):
        try:
            with job.join(key).open_read() as f:
                note = json.loads(f.read())
            at, worker, reason = float(note["at"]), str(note["worker"]), str(note["reason"])
        except (StorageError, ValueError, KeyError, TypeError):
            continue
        yield (
            key.split("/", 1)[1].removesuffix(".json"),
            {
                "at": at,
                "worker": worker,
                "reason": reason,
            },
        )


def _latest_attempts(job: Storage) -> dict[str, float]:
    latest: dict[str, float] = {}
    for key in _keys(job, "attempts/"):
        shard_id = key.split("/", 1)[1].rsplit(".", 1)[0]
        try:
            with job.join(key).open_read() as f:
                at = float(json.loads(f.read())["at"])
        except (StorageError, ValueError, KeyError, TypeError):
            continue
        latest[shard_id] = max(at, latest.get(shard_id, 0.0))
    return latest


def _keys(job: Storage, prefix: str) -> list[str]:
    try:
        return list(job.list(prefix))
    except (StorageError, FileNotFoundError):
        return []

"""The end of a distributed job: delivery attempts, shard results written once, poison shards,
and the merge into output.jsonl / errors.jsonl / batch.json.

    <job>/attempts/<shard_id>.<n>      attempt n of a shard was claimed (write_if_absent)
    <job>/results/<shard_id>.jsonl     {"index": i, "record": <output or error line>} per request
    <job>/finalize.json                the completion time, claimed once (so reruns write the
                                       same bytes)
    <job>/output.jsonl, errors.jsonl   the merge; batch.json is written last

Every step is idempotent: a redelivered shard finds its result written (first writer wins), a
finalizer that dies is replaced by the next call to try_finalize, and two finalizers running at
once write identical bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from jobs.batch_record import BatchRecord
from jobs.responses import error_line
from jobs.shards import ShardMessage, read_shard
from jobs.storage import Storage, StorageError, validate_key_part
from jobs.validate import LineError


def read_manifest(job: Storage) -> dict:
    """The job's job.json (written last by submit)."""
    with job.join("job.json").open_read() as f:
        return json.loads(f.read())


def record_attempt(job: Storage, shard_id: str, max_attempts: int) -> int | None:
    """Claim the next delivery attempt of a shard: its number n (1, 2, ...), or None when n
    would exceed `max_attempts` (a poison shard: fail it with fail_shard)."""
    validate_key_part(shard_id)
    stamp = json.dumps({"at": time.time()}).encode()
    for n in range(1, max_attempts + 1):
        if job.join("attempts", f"{shard_id}.{n}").write_if_absent(stamp):
            return n
    return None


def _result(job: Storage, shard_id: str) -> Storage:
    return job.join("results", f"{validate_key_part(shard_id)}.jsonl")


def has_result(job: Storage, shard_id: str) -> bool:
    return _result(job, shard_id).exists()


def write_shard_result(job: Storage, shard_id: str, records: list[tuple[int, dict]]) -> bool:
    """Write a shard's result once: False if another delivery already wrote it."""
    data = b"".join(
        json.dumps({"index": i, "record": r}, ensure_ascii=False).encode() + b"\n"
        for i, r in records
    )
    return _result(job, shard_id).write_if_absent(data)


def fail_shard(job: Storage, msg: ShardMessage, reason: str) -> bool:
    """Give up on a poison shard: each of its requests becomes an error line (code
    shard_failed), written as the shard's result. False if a result was already written."""
    manifest = read_manifest(job)
    try:
        requests = read_shard(msg)
    except ValueError:  # a payload that changed still names its lines
        requests = read_shard(msg, verify=False)
    records = []
    for r in requests:
        err = LineError(
            r.line,
            r.custom_id,
            "shard_failed",
            f"line {r.line}: shard {msg.shard_id} failed: {reason}",
        )
        records.append((r.index, error_line(err, batch_id=manifest["batch_id"])))
    return write_shard_result(job, msg.shard_id, records)


def _read_lines(target: Storage) -> Iterator[bytes]:
    with target.open_read() as f:
        for line in f:
            if line.strip():
                yield line


def try_finalize(job: Storage) -> BatchRecord | None:
    """Merge the job if every shard has a result: output.jsonl (answers, input order),
    errors.jsonl (every error line, by input line), then batch.json (completed, counts, usage).
    None when a shard has no result yet. Safe to call any number of times, concurrently."""
    manifest = read_manifest(job)
    done = set(job.list("results/"))
    if any(f"results/{s['shard_id']}.jsonl" not in done for s in manifest["shards"]):
        return None

    answered: list[tuple[int, bytes]] = []
    errors: list[tuple[int, bytes]] = []
    record = _record(job, manifest)
    for shard in manifest["shards"]:
        for raw in _read_lines(_result(job, shard["shard_id"])):
            item = json.loads(raw)
            line = item["record"]
            data = json.dumps(line, ensure_ascii=False).encode() + b"\n"
            if line.get("error"):
                errors.append((line["error"]["line"], data))
            else:
                answered.append((item["index"], data))
                record.add_usage(line["response"]["body"]["usage"])
    for raw in _read_lines(job.join("validation_errors.jsonl")):
        errors.append((json.loads(raw)["error"]["line"], raw))
    answered.sort(key=lambda x: x[0])
    errors.sort(key=lambda x: x[0])
    with job.join("output.jsonl").open_write() as f:
        for _, data in answered:
            f.write(data)
    with job.join("errors.jsonl").open_write() as f:
        for _, data in errors:
            f.write(data)

    # One completion time for every finalizer: the first claims it, the others read it.
    marker = job.join("finalize.json")
    marker.write_if_absent(json.dumps({"completed_at": int(time.time())}).encode())
    with marker.open_read() as f:
        completed_at = json.loads(f.read())["completed_at"]
    record.finish(completed=len(answered), failed=len(errors))
    record.finalizing_at = record.completed_at = completed_at
    job.join("batch.json").write_bytes(json.dumps(record.to_dict(), indent=2).encode() + b"\n")
    return record


def _record(job: Storage, manifest: dict) -> BatchRecord:
    record = BatchRecord.start(
        batch_id=manifest["batch_id"],
        input_uri=manifest["input"],
        output_uri=job.join("output.jsonl").uri,
        errors_uri=job.join("errors.jsonl").uri,
        model=manifest["model"],
    )
    record.created_at = record.in_progress_at = manifest["created_at"]
    urls = manifest.get("urls") or []
    record.endpoint = urls[0] if len(urls) == 1 else None
    return record


def job_status(job: Storage) -> dict:
    """Where a job stands, from job.json, results/ and batch.json (no torch, no queue)."""
    manifest = read_manifest(job)
    done = set(job.list("results/"))
    shards_done = sum(f"results/{s['shard_id']}.jsonl" in done for s in manifest["shards"])
    status = {
        "job_id": manifest["job_id"],
        "batch_id": manifest["batch_id"],
        "status": "in_progress",
        "shards_total": len(manifest["shards"]),
        "shards_done": shards_done,
        "requests": manifest["num_requests"],
        "invalid": manifest["num_invalid"],
        "request_counts": None,
    }
    try:
        with job.join("batch.json").open_read() as f:
            batch = json.loads(f.read())
        status["status"] = batch["status"]
        if batch["status"] == "completed":
            status["request_counts"] = batch["request_counts"]
            status["usage"] = batch["usage"]
    except StorageError:
        pass
    return status

"""The end of a distributed job: delivery attempts, shard results written once, poison shards,
and the merge into output.jsonl / errors.jsonl / batch.json.

    <job>/attempts/<shard_id>.<n>      attempt n of a shard was claimed (write_if_absent)
    <job>/results/<shard_id>.jsonl     {"index": i, "record": <output or error line>} per request
    <job>/cancel                       `kvbatch cancel` was asked (jobs/distributed/cancel.py)
    <job>/failures/<shard_id>.json     why the shard last failed (worker/tasks.py), shown by
                                       job_status while the shard has no result
    <job>/progress/<shard_id>.json     how far a running shard is (jobs/distributed/shard_progress.py)
    <job>/finalize.json                the completion time and whether the job was cancelled,
                                       claimed once (so reruns write the same bytes)
    <job>/output.jsonl, errors.jsonl   the merge; batch.json is written last; streamed
                                       (jobs/distributed/sorted_runs.py: shard results are in
                                       prefix order, sorted runs on local disk, a k-way merge),
                                       so a million answers are never in memory at once

Every step is idempotent: a redelivered shard finds its result written (first writer wins), a
finalizer that dies is replaced by the next call to try_finalize, and two finalizers running at
once write identical bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from kvbatch.jobs.distributed.cancelled import (
    CANCEL_MARKER,
    CANCELLED,
    cancel_requested,
    cancelled_message,
)
from kvbatch.jobs.distributed.shard_progress import running_progress
from kvbatch.jobs.distributed.shards import ShardMessage, read_shard, read_shard_lines
from kvbatch.jobs.distributed.sorted_runs import DEFAULT_RUN_BYTES, SortedRuns
from kvbatch.jobs.distributed.waiting import unclaimed_hint, waiting_shards
from kvbatch.jobs.openai_format.batch_record import MAX_BATCH_ERRORS, BatchRecord
from kvbatch.jobs.openai_format.responses import error_line
from kvbatch.jobs.openai_format.schemas import CHAT_URL
from kvbatch.jobs.openai_format.validate import LineError
from kvbatch.jobs.storage import Storage, StorageError, validate_key_part

RUN_BYTES = DEFAULT_RUN_BYTES  # lines sorted in memory before they spill to a run file


def read_manifest(job: Storage) -> dict:
    """The job's job.json (written last by submit). A file that is not a manifest (damaged,
    or overwritten by something else) raises StorageError naming it."""
    manifest = read_job_file(job, "job.json")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise DamagedFile(
            f"{job.join('job.json').uri} is not a job manifest (no list of shards): it was "
            "overwritten or damaged; resubmit the input"
        )
    return manifest


class DamagedFile(StorageError):
    """A file of the job's folder that is there but cannot be read as what it should be."""


def read_job_file(job: Storage, name: str):
    """A JSON file of the job's folder; one that is not JSON raises StorageError naming it
    (a bare "Extra data: line 1 column 5" says neither which file nor what to do)."""
    target = job.join(name)
    with target.open_read() as f:
        data = f.read()
    try:
        return json.loads(data)
    except ValueError as e:
        raise DamagedFile(
            f"{target.uri} is not valid JSON ({e}): it was overwritten or damaged"
        ) from None


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
    return _write_error_result(
        job, msg, "shard_failed", lambda line: f"line {line}: shard {msg.shard_id} failed: {reason}"
    )


def cancel_shard(job: Storage, msg: ShardMessage) -> bool:
    """Skip a shard of a cancelled job: each of its requests becomes a batch_cancelled error
    line, written as the shard's result. False if a result was already written."""
    return _write_error_result(
        job,
        msg,
        CANCELLED,
        cancelled_message,
    )


def _write_error_result(job: Storage, msg: ShardMessage, code: str, message) -> bool:
    manifest = read_manifest(job)
    try:
        requests = [(r.index, r.line, r.custom_id) for r in _read_payload(msg)]
    except StorageError:  # the payload cannot be read (access denied, gone): its lines index
        requests = read_shard_lines(job, msg.shard_id)
    records = [
        (index, error_line(LineError(line, custom_id, code, message(line)),
                           batch_id=manifest["batch_id"]))
        for index, line, custom_id in requests
    ]  # fmt: skip
    return write_shard_result(job, msg.shard_id, records)


def _read_payload(msg: ShardMessage):
    try:
        return read_shard(msg)
    except ValueError:  # a payload that changed still names its lines
        return read_shard(msg, verify=False)


def _read_lines(target: Storage) -> Iterator[bytes]:
    with target.open_read() as f:
        for line in f:
            if line.strip():
                yield line


def read_shard_result(job: Storage, shard_id: str) -> list[dict]:
    """The output or error lines a shard's result holds (raises StorageError if unwritten)."""
    return [json.loads(raw)["record"] for raw in _read_lines(_result(job, shard_id))]


def try_finalize(job: Storage) -> BatchRecord | None:
    """Merge the job if every shard has a result: output.jsonl (answers, input order),
    errors.jsonl (every error line, by input line), then batch.json (completed, counts, usage).
    None when a shard has no result yet. Safe to call any number of times, concurrently."""
    manifest = read_manifest(job)
    done = set(job.list("results/"))
    if any(f"results/{s['shard_id']}.jsonl" not in done for s in manifest["shards"]):
        return None

    record = _record(job, manifest)
    with SortedRuns(run_bytes=RUN_BYTES) as answered, SortedRuns(run_bytes=RUN_BYTES) as errors:
        for shard in manifest["shards"]:
            for raw in _read_lines(_result(job, shard["shard_id"])):
                item = json.loads(raw)
                line = item["record"]
                data = json.dumps(line, ensure_ascii=False).encode() + b"\n"
                if line.get("error"):
                    errors.add(line["error"]["line"], data)
                else:
                    answered.add(item["index"], data)
                    record.add_usage(line["response"]["body"]["usage"])
        for raw in _read_lines(job.join("validation_errors.jsonl")):
            errors.add(json.loads(raw)["error"]["line"], raw)
        with job.join("output.jsonl").open_write() as f:
            for _, data in answered.merged():
                f.write(data)
        samples = []  # the first errors, by line, for batch.json
        with job.join("errors.jsonl").open_write() as f:
            for _, data in errors.merged():
                f.write(data)
                if len(samples) < MAX_BATCH_ERRORS:
                    samples.append(json.loads(data)["error"])
        num_answered, num_errors = answered.count, errors.count

    # One completion time (and one cancelled-or-not) for every finalizer: the first claims
    # it, the others read it. A cancel that comes after this claim changes nothing.
    claim = {"completed_at": int(time.time()), "cancelled": cancel_requested(job)}
    marker = job.join("finalize.json")
    marker.write_if_absent(json.dumps(claim).encode())
    with marker.open_read() as f:
        claim = json.loads(f.read())
    completed_at = claim["completed_at"]
    record.finish(
        completed=num_answered,
        failed=num_errors,
        ran=int(manifest.get("num_requests") or 0),
        samples=samples,
    )
    record.finalizing_at = record.completed_at = completed_at
    if claim.get("cancelled"):
        record.mark_cancelled(cancelling_at=_cancel_time(job) or completed_at, at=completed_at)
    job.join("batch.json").write_bytes(json.dumps(record.to_dict(), indent=2).encode() + b"\n")
    return record


def mark_job_failed(job: Storage, code: str, reason: str) -> None:
    """Mark a job that can never finish "failed" in batch.json, with the reason as its errors
    (OpenAI's shape: {"object": "list", "data": [{"code", "message"}]}). A job already
    finalized is left as it is."""
    if job.join("finalize.json").exists():
        return
    target = job.join("batch.json")
    with target.open_read() as f:
        batch = json.loads(f.read())
    batch["status"] = "failed"
    batch["failed_at"] = int(time.time())
    batch["errors"] = {"object": "list", "data": [{"code": code, "message": reason}]}
    target.write_bytes(json.dumps(batch, indent=2).encode() + b"\n")


def _cancel_time(job: Storage) -> int | None:
    try:
        with job.join(CANCEL_MARKER).open_read() as f:
            return int(json.loads(f.read())["at"])
    except (StorageError, ValueError, KeyError, TypeError):
        return None


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
    record.endpoint = manifest.get("endpoint") or (urls[0] if urls else CHAT_URL)
    return record


def job_status(job: Storage, *, now: float | None = None) -> dict:
    """Where a job stands, from job.json, results/, attempts/, the cancel marker and
    batch.json (no torch, no queue).

    `completed` and `failed` count the lines of the shard results written so far;
    `running_finished` the requests done inside shards still running, from the progress the
    workers write now and then (jobs/distributed/shard_progress.py). `tokens_per_s` is the output tokens
    of both over the time since the first shard was claimed (until finalize once finished):
    an average over the job's life. `eta_s` assumes the rest of the requests go at the
    average rate so far; None until a request is done.
    """
    manifest = read_manifest(job)
    done = set(job.list("results/"))
    written = [
        s["shard_id"] for s in manifest["shards"] if f"results/{s['shard_id']}.jsonl" in done
    ]
    status = {
        "job_id": manifest["job_id"],
        "batch_id": manifest["batch_id"],
        "status": "in_progress",
        "shards_total": len(manifest["shards"]),
        "shards_done": len(written),
        "requests": manifest["num_requests"],
        "invalid": manifest["num_invalid"],
        "request_counts": None,
    }
    progress = _progress(job, written)
    running = [s["shard_id"] for s in manifest["shards"] if s["shard_id"] not in set(written)]
    in_shards = running_progress(job, running)  # requests done inside shards still running
    status["running_finished"] = in_shards["finished"]
    try:
        batch = read_job_file(job, "batch.json")
        status["status"] = batch["status"]
        if batch["status"] in ("completed", "cancelled"):
            status["request_counts"] = batch["request_counts"]
            status["usage"] = batch["usage"]
        if batch.get("errors"):
            status["errors"] = [e.get("message") for e in batch["errors"].get("data", [])]
    except DamagedFile:
        raise
    except StorageError:  # not written yet
        pass
    # Why shards without a result last failed (worker/tasks.py notes it): a job stuck
    # in_progress because its results cannot be written says so here.
    status["shard_failures"] = {
        key.split("/", 1)[1].removesuffix(".json"): reason for key, reason in _failures(job, done)
    }
    # Shards a worker left to others (its model is not the job's), and a job no worker took.
    status["shard_waits"] = waiting_shards(job, done)
    status["hint"] = unclaimed_hint(job, manifest, time.time() if now is None else now)
    if status["status"] == "in_progress" and cancel_requested(job):
        status["status"] = "cancelling"
    started = _first_attempt_time(job)
    finished = status["status"] in ("completed", "cancelled")
    end = _finalize_time(job) if finished else None
    end = end if end is not None else (time.time() if now is None else now)
    elapsed = max(0.0, end - started) if started is not None else None
    answered = progress["completed"] + progress["failed"] + in_shards["finished"]
    status.update(progress)
    status["output_tokens"] += in_shards["output_tokens"]
    status["elapsed_s"] = round(elapsed, 1) if elapsed is not None else None
    status["tokens_per_s"] = round(status["output_tokens"] / elapsed, 1) if elapsed else None
    status["eta_s"] = None
    if finished:
        status["eta_s"] = 0.0
    elif elapsed and answered and status["status"] == "in_progress":
        status["eta_s"] = round((status["requests"] - answered) * elapsed / answered, 1)
    return status


def _failures(job: Storage, done: set[str]):
    """(key, reason) of the failure notes of shards that have no result yet."""
    try:
        keys = list(job.list("failures/"))
    except StorageError:
        return
    for key in keys:
        shard_id = key.split("/", 1)[1].removesuffix(".json")
        if f"results/{shard_id}.jsonl" in done:
            continue
        try:
            with job.join(key).open_read() as f:
                yield key, json.loads(f.read())["reason"]
        except (StorageError, ValueError, KeyError, TypeError):
            continue


def _progress(job: Storage, shard_ids: list[str]) -> dict:
    """Line counts and output tokens of the written shard results."""
    counts = {"completed": 0, "failed": 0, "cancelled": 0, "output_tokens": 0}
    for shard_id in shard_ids:
        for raw in _read_lines(_result(job, shard_id)):
            line = json.loads(raw)["record"]
            if line.get("error"):
                counts["failed"] += 1
                counts["cancelled"] += line["error"]["code"] == CANCELLED
            else:
                counts["completed"] += 1
                usage = line["response"]["body"]["usage"]  # an embedding's has no completion
                counts["output_tokens"] += usage.get("completion_tokens", 0)
    return counts


def _first_attempt_time(job: Storage) -> float | None:
    times = []
    for key in job.list("attempts/"):
        try:
            with job.join(key).open_read() as f:
                times.append(float(json.loads(f.read())["at"]))
        except (StorageError, ValueError, KeyError, TypeError):
            continue
    return min(times) if times else None


def _finalize_time(job: Storage) -> float | None:
    try:
        with job.join("finalize.json").open_read() as f:
            return float(json.loads(f.read())["completed_at"])
    except (StorageError, ValueError, KeyError, TypeError):
        return None

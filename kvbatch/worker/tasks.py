"""The shard task: one queue message = one shard of a job, run on this process's model.

A message is a claim check, `{"output": prefix, "shard": ShardMessage dict}`: the worker
finds the job's folder from the prefix and the job id, and the payload from the shard's uri.

    validate the message  -> bad (or a relative output path): reject (acknowledged, never
                             retried)
    compare with job.json -> another sha256/uri, or no such shard (tampered or stale): dropped,
                             logged and counted; no attempt claimed, no result written
    result already there  -> a duplicate delivery: nothing to run
    job cancelled         -> the shard's lines become batch_cancelled records (jobs/distributed/cancel.py)
    another model         -> job.json's model_fingerprint is not this worker's checkpoint
                             (jobs/model_fingerprint.py): no attempt claimed, the reason noted
                             for `kvbatch status` (jobs/distributed/waiting.py), sent again
                             later for a worker that has the job's model
    running elsewhere     -> a fresh heartbeat (jobs/distributed/running.py): a redelivery of a shard that
                             still runs; sent again later, no attempt claimed
    record_attempt        -> None (the cap is reached): the shard's lines become error records
    run_shard on the model, beating its heartbeat (stopping between engine steps if the job is
    cancelled meanwhile); a payload that does not match its sha256 fails the shard at once
    (no attempt could succeed); write_shard_result (written once), try_finalize

Each outcome is counted in worker/metrics.py (shards by status, lines by status per job), and
the engine is observed between its steps (at most once a second) and after the shard.

A shard that raises is retried by Celery after a short countdown; one that kills its worker
comes back through acks_late + reject_on_worker_lost (or the broker's visibility timeout).
Either way each delivery records an attempt, so the attempt markers cap the total. A failure
in any other step (storage unreachable, finalize) is retried with backoff up to INFRA_RETRIES
times, then the shard is failed: Celery acknowledges a failed task, so none may fail silently.
On SQS a heartbeat thread keeps the message invisible while the shard runs (broker/sqs.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery, Task
from celery.exceptions import Ignore, Reject, Retry

from kvbatch.broker.settings import TASK_NAME, visibility_timeout
from kvbatch.broker.sqs import visibility_heartbeat
from kvbatch.env_settings import env_number
from kvbatch.jobs.distributed.cancel import CancelCheck
from kvbatch.jobs.distributed.cancelled import cancel_requested
from kvbatch.jobs.distributed.finalize import (
    cancel_shard,
    fail_shard,
    has_result,
    read_manifest,
    read_shard_result,
    record_attempt,
    try_finalize,
    write_shard_result,
)
from kvbatch.jobs.distributed.running import running, running_elsewhere
from kvbatch.jobs.distributed.shard_progress import ProgressWriter
from kvbatch.jobs.distributed.shards import (
    PayloadMismatch,
    ShardMessage,
    job_dir,
    manifest_mismatch,
    run_shard,
)
from kvbatch.jobs.distributed.waiting import note_waiting
from kvbatch.jobs.job_context import engine_settings, runs_at
from kvbatch.jobs.model_fingerprint import (
    FingerprintError,
    ModelFingerprint,
    describe_mismatch,
    fingerprint,
)
from kvbatch.jobs.storage import Storage, StorageError, is_relative_path
from kvbatch.worker import metrics

log = logging.getLogger("kvbatch.worker")

DEFAULT_MAX_ATTEMPTS = 3
# Seconds before a shard that raised runs again. Far below the visibility timeout: a Redis
# countdown message waits unacknowledged in the worker, and one longer than the visibility
# timeout would be handed out again and again (docs/DISTRIBUTED.md).
RETRY_COUNTDOWN = 2
# Retries of a failure outside the shard's run (storage, finalize), backing off 2, 4, ... s up
# to MAX_RETRY_COUNTDOWN: about two minutes in all before the shard is failed.
INFRA_RETRIES = 6
MAX_RETRY_COUNTDOWN = 60
# Seconds before a delivery of a shard that runs elsewhere is tried again.
RUNNING_RECHECK = 5
# Seconds before a shard this worker's model cannot run is offered again (to any worker).
OTHER_MODEL_RECHECK = 5
# WorkerModel.llm's default: whatever reasoning parser the loaded engine has.
_AS_LOADED = object()

# Names this process in the running heartbeat of the shard it runs.
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class WorkerModel:
    """The one model of a worker process, loaded once (solo pool: the process runs shards
    itself, so the model never crosses a fork), and again only for a job that runs at another
    context (kvbatch.jobs.job_context)."""

    path: str
    engine: dict = field(default_factory=dict)  # engine.LLM keyword arguments
    _llm: Any = field(default=None, repr=False)
    _longest: int = field(default=0, repr=False)  # the longest_request it was loaded with
    _parser: str | None = field(default=None, repr=False)  # the reasoning parser named at load
    _fingerprint: ModelFingerprint | None = field(default=None, repr=False)

    def fingerprint(self) -> ModelFingerprint:
        """The loaded checkpoint's fingerprint (of the folder or file the engine read: a Hub
        id's snapshot), computed once."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.llm().engine.config.model)
        return self._fingerprint

    def llm(self, longest_request: int = 0, reasoning_parser: str | None | object = _AS_LOADED):
        """The engine. `longest_request` (a job's, from job.json; 0 = none recorded) is the
        context the job runs at unless the worker's --max-model-len is set: an engine loaded at
        another is dropped and loaded again at the job's, so every shard of a job runs at the
        same context as `kvbatch run` would, whichever worker takes it. `reasoning_parser`
        (`submit --reasoning-parser`, from job.json; None: the job named none) wins over the
        worker's own the same way: submit rendered the job's prompts for it. Left out, the
        engine keeps the parser it has."""
        wanted = 0 if self.engine.get("max_model_len") else longest_request
        if reasoning_parser is _AS_LOADED:
            parser = self._parser if self._llm is not None else self.engine.get("reasoning_parser")
        else:
            parser = reasoning_parser or self.engine.get("reasoning_parser")
        if self._llm is not None and not runs_at(self._llm.engine, wanted):
            log.info("loading %s again for a job whose longest request is %d tokens",
                     self.path, wanted)  # fmt: skip
            self._llm = None  # the next engine's start frees this one's memory first
        if self._llm is not None and parser != self._parser:
            log.info("loading %s again for a job with reasoning parser %s", self.path, parser)
            self._llm = None
        if self._llm is None:
            from kvbatch.engine import LLM  # torch is imported here, not at kvbatch.worker start-up

            log.info("loading %s", self.path)
            self._longest = wanted or self._longest
            settings = engine_settings(self.engine, self._longest)
            self._parser = parser
            if parser:
                settings = {**settings, "reasoning_parser": parser}
            self._llm = LLM(model=self.path, **settings)
        return self._llm


class ShardTask(Task):
    """The shard task's class. It owns the process's model, loaded once: the solo pool runs
    shards in the worker's own process, so the model never crosses a fork (Celery's pattern
    for a resource a task keeps across calls)."""

    model: WorkerModel | None = None

    def use_model(self, model: WorkerModel) -> None:
        """Set the model this task runs shards on (once, by `kvbatch worker`)."""
        self.model = model


def run_shard_task(self: ShardTask, output: str, shard: dict) -> dict:
    """The task (bound): run one shard of the job under `output`."""
    return handle_shard(self, output, shard)


def register(app: Celery) -> None:
    """Register the shard task on `app` (one function for every app, so Celery sees one
    callable under the task's name)."""
    # max_retries=None on the task: Celery's own cap (3 by default, and `retry(max_retries=
    # None)` falls back to it) would fail the message past it; the attempt markers and
    # INFRA_RETRIES are the caps. Celery's retry_backoff does not fit: past its last retry it
    # fails (and acknowledges) the message, where a shard must still get its error records.
    app.task(
        name=TASK_NAME,
        base=ShardTask,
        bind=True,
        acks_late=True,
        reject_on_worker_lost=True,
        max_retries=None,
    )(run_shard_task)


class StageFailed(Exception):
    """A step outside the shard's run failed (storage unreachable, ...): retried, then the
    shard is failed."""

    def __init__(self, stage: str, error: Exception):
        super().__init__(f"{stage} failed: {error}")
        self.stage, self.error = stage, error


@contextmanager
def stage(name: str) -> Iterator[None]:
    """A named step of the task: an exception in it leaves as StageFailed(name, error), which
    handle_shard retries with backoff and names in the failure it records."""
    try:
        yield
    except (Retry, Reject, Ignore, StageFailed):
        raise
    except Exception as e:
        raise StageFailed(name, e) from e


READING_MANIFEST = "reading job.json"


def handle_shard(task: ShardTask, output: str, shard: dict) -> dict:
    """The task's body (see the module docstring); returns a small summary.

    Every path ends in a written shard result, a retry, or a failure record: an exception
    outside the shard's run (storage unreachable while reading job.json, claiming an attempt,
    writing the result, finalizing) is retried with backoff up to INFRA_RETRIES times, then
    the shard is failed (fail_shard) so the job still finalizes. Only when even that cannot be
    written is the message given up, with the reason in the log (and in
    `<job>/failures/<shard_id>.json` when that can be written)."""
    msg, job = _parse(output, shard)
    if task.model is None:
        raise RuntimeError("this process has no model: start workers with `kvbatch worker`")
    with visibility_heartbeat(task):
        try:
            return _handle(task, msg, job)
        except StageFailed as e:
            return _failed_outside_run(task, msg, job, e.stage, e.error)
        except (Retry, Reject, Ignore):
            raise
        except Exception as e:  # outside every stage: still never silent
            return _failed_outside_run(task, msg, job, "handling the shard", e)


def _handle(task: ShardTask, msg: ShardMessage, job: Storage) -> dict:
    with stage(READING_MANIFEST):
        manifest = read_manifest(job)
    summary = {"job_id": msg.job_id, "shard_id": msg.shard_id}
    outcome = (
        _drop_if_not_in_manifest(msg, manifest)
        or _finish_if_written(msg, job)
        or _skip_if_cancelled(msg, job)
        or _defer_if_other_model(task, msg, job, manifest)
        or _defer_if_running(task, msg, job)
        or _claim_and_run(task, msg, job, manifest)
    )
    return {**summary, **outcome}


def _drop_if_not_in_manifest(msg: ShardMessage, manifest: dict) -> dict | None:
    """A tampered or stale message: it claims no attempt and writes no result, so the real
    message (or `kvbatch resend`) still runs the shard."""
    mismatch = manifest_mismatch(manifest, msg)
    if mismatch is None:
        return None
    log.warning("%s/%s: dropping a message that does not match job.json: %s",
                msg.job_id, msg.shard_id, mismatch)  # fmt: skip
    metrics.message_dropped("mismatch")
    return {"dropped": True}


def _finish_if_written(msg: ShardMessage, job: Storage) -> dict | None:
    """A duplicate delivery: the result is there; finalize (in case the last finalizer died)."""
    with stage("checking for a result"):
        written = has_result(job, msg.shard_id)
    if not written:
        return None
    log.info("%s/%s: already written (a duplicate delivery)", msg.job_id, msg.shard_id)
    metrics.shard_finished(msg.job_id, "duplicate")
    _finalize(job)
    return {"duplicate": True}


def _skip_if_cancelled(msg: ShardMessage, job: Storage) -> dict | None:
    with stage("checking for a cancel"):
        cancelled = cancel_requested(job)
    if not cancelled:
        return None
    log.info("%s/%s: the job was cancelled; skipping the shard", msg.job_id, msg.shard_id)
    with stage("writing the cancelled result"):
        written = cancel_shard(job, msg)
    _count_written(msg, "cancelled", job if written else None)
    _finalize(job)
    return {"cancelled": True}


def _defer_if_other_model(
    task: ShardTask, msg: ShardMessage, job: Storage, manifest: dict
) -> dict | None:
    """A shard of a job submitted for another checkpoint (model_fingerprint in job.json): this
    worker would answer with the wrong model. It claims no attempt, notes why the shard waits
    (`kvbatch status` shows it) and sends the shard back to the queue for a worker that has
    the job's model. A job without a fingerprint (submitted by an older kvbatch) runs."""
    recorded = manifest.get("model_fingerprint")
    if recorded is None:
        return None
    try:
        task.model.llm()
    except Exception:  # a model that cannot load fails the run itself: attempts count it
        return None
    with stage("fingerprinting the model"):
        mine = task.model.fingerprint()
    try:
        reason = describe_mismatch(ModelFingerprint.from_dict(recorded), mine)
    except FingerprintError as e:
        reason = f"job.json's model_fingerprint cannot be read ({e})"
    if reason is None:
        return None
    reason = f"{reason}; the job is for {manifest.get('model')}, this worker has {task.model.path}"
    log.warning("%s/%s: not running it: %s; leaving it for a worker with the job's model "
                "(offered again in %d s)", msg.job_id, msg.shard_id, reason,
                OTHER_MODEL_RECHECK)  # fmt: skip
    with stage("noting why the shard waits"):
        note_waiting(job, msg.shard_id, WORKER_ID, reason)
    metrics.message_deferred()
    raise task.retry(countdown=OTHER_MODEL_RECHECK, max_retries=None)


def _defer_if_running(task: ShardTask, msg: ShardMessage, job: Storage) -> dict | None:
    """A redelivery (visibility timeout) of a shard that still runs: claiming an attempt here
    would use up its attempts. Come back later; by then it has a result, or its heartbeat went
    stale because its worker died."""
    with stage("checking whether the shard runs elsewhere"):
        owner = running_elsewhere(job, msg.shard_id)
    if owner is None:
        return None
    log.info("%s/%s: running on %s; delivering again in %d s",
             msg.job_id, msg.shard_id, owner, RUNNING_RECHECK)  # fmt: skip
    metrics.message_deferred()
    raise task.retry(countdown=RUNNING_RECHECK, max_retries=None)


def _claim_and_run(task: ShardTask, msg: ShardMessage, job: Storage, manifest: dict) -> dict:
    max_attempts = int(manifest.get("max_attempts") or DEFAULT_MAX_ATTEMPTS)
    with stage("claiming an attempt"):
        attempt = record_attempt(job, msg.shard_id, max_attempts)
    if attempt is None:
        reason = _last_failure(job, msg) or (
            f"shard {msg.shard_id} failed {max_attempts} times (it raised or killed its "
            "worker each time); its requests were given up"
        )
        log.error("%s/%s: %s", msg.job_id, msg.shard_id, reason)
        return _give_up(msg, job, "poisoned", reason)
    log.info("%s/%s: attempt %d of %d", msg.job_id, msg.shard_id, attempt, max_attempts)
    llm = None
    started = time.monotonic()
    try:
        llm = task.model.llm(
            int(manifest.get("longest_request") or 0), manifest.get("reasoning_parser")
        )
        model_name = manifest.get("model_name") or Path(task.model.path.rstrip("/")).name
        metrics.set_model(model_name)
        with running(job, msg.shard_id, WORKER_ID):
            records = run_shard(
                llm,
                msg,
                model_name=model_name,
                on_output=metrics.request_finished,
                batch_id=manifest.get("batch_id") or msg.job_id,
                created=manifest.get("created_at"),
                should_stop=_slowed(
                    ProgressWriter(
                        job, msg.shard_id, llm, metrics.StepObserver(llm, CancelCheck(job))
                    )
                ),
            )
    except PayloadMismatch as e:  # no attempt can succeed: fail it now, never retry
        log.error("%s/%s: %s", msg.job_id, msg.shard_id, e)
        return _give_up(msg, job, "failed", str(e))
    except Exception as e:
        if llm is not None:
            metrics.safe_observe(llm)
        _note_failure(job, msg, f"attempt {attempt} raised: {e}")
        if attempt < max_attempts:
            log.warning(
                "%s/%s: attempt %d raised %r; retrying", msg.job_id, msg.shard_id, attempt, e
            )
            raise task.retry(exc=e, countdown=RETRY_COUNTDOWN) from e
        log.exception("%s/%s: last attempt raised", msg.job_id, msg.shard_id)
        reason = f"shard {msg.shard_id} raised on its last attempt: {e}"
        return _give_up(msg, job, "failed", reason)
    metrics.safe_observe(llm)
    with stage("writing the result"):
        written = write_shard_result(job, msg.shard_id, records)
    metrics.shard_finished(
        msg.job_id,
        "done" if written else "duplicate",
        metrics.lines_by_status(records) if written else None,
        seconds=time.monotonic() - started,
    )
    _finalize(job)
    return {"records": len(records), "written": written}


def _give_up(msg: ShardMessage, job: Storage, status: str, reason: str) -> dict:
    """Write the shard's lines as shard_failed error records (once) and finalize."""
    with stage("writing the failed result"):
        written = fail_shard(job, msg, reason)
    _count_written(msg, status, job if written else None)
    _finalize(job)
    return {"failed": True}


def _finalize(job: Storage) -> None:
    with stage("finalizing the job"):
        try_finalize(job)


def _failed_outside_run(task, msg, job, step: str, error: Exception) -> dict:
    """An exception outside the shard's run: retry with backoff, then fail the shard."""
    where = f"{msg.job_id}/{msg.shard_id}"
    if step == READING_MANIFEST and _exists(job.join("job.json")) is False:
        log.error("%s: the job has no job.json at %s (deleted, or a folder this worker "
                  "cannot see?); dropping the shard", where, job.join("job.json").uri)  # fmt: skip
        return {"job_id": msg.job_id, "shard_id": msg.shard_id, "dropped": True}
    _note_failure(job, msg, f"{step} failed: {error}")
    retries = int(getattr(task.request, "retries", 0) or 0)
    if retries < INFRA_RETRIES:
        countdown = min(RETRY_COUNTDOWN * 2**retries, _max_countdown())
        log.warning("%s: %s failed (%s); retry %d of %d in %d s", where, step, error,
                    retries + 1, INFRA_RETRIES, countdown)  # fmt: skip
        raise task.retry(exc=error, countdown=countdown) from error
    reason = f"shard {msg.shard_id} failed while {step}, {INFRA_RETRIES + 1} times: {error}"
    log.error("%s: %s; giving up on the shard", where, reason)
    try:
        written = fail_shard(job, msg, reason)
        _count_written(msg, "failed", job if written else None)
        try_finalize(job)
    except Exception as e:
        log.critical(
            "%s: cannot record the shard's failure either (%s): the job stays in_progress. "
            "Fix the storage, then resubmit the input (or send the shard again)",
            where, e,
        )  # fmt: skip
        raise
    return {"job_id": msg.job_id, "shard_id": msg.shard_id, "failed": True}


def _exists(target) -> bool | None:
    try:
        return target.exists()
    except Exception:
        return None


def _max_countdown() -> int:
    """Backoff stays well below the visibility timeout: on Redis a countdown message waits
    unacknowledged in the worker and would be handed out again past it."""
    try:
        return max(1, min(MAX_RETRY_COUNTDOWN, visibility_timeout() // 4))
    except ValueError:
        return MAX_RETRY_COUNTDOWN


def _note_failure(job, msg, reason: str) -> None:
    """Best effort: `<job>/failures/<shard_id>.json` says why the shard last failed, for
    `kvbatch status` and for the error records of a shard given up later."""
    try:
        payload = json.dumps({"at": time.time(), "reason": reason}).encode()
        job.join("failures", f"{msg.shard_id}.json").write_bytes(payload)
    except Exception as e:
        log.warning("%s/%s: could not note the failure: %s", msg.job_id, msg.shard_id, e)


def _last_failure(job, msg) -> str | None:
    try:
        with job.join("failures", f"{msg.shard_id}.json").open_read() as f:
            reason = json.loads(f.read())["reason"]
    except Exception:
        return None
    return f"shard {msg.shard_id} was given up after its last attempt; last failure: {reason}"


def step_delay() -> float:
    """KVBATCH_STEP_DELAY (seconds, for tests of long shards): a sleep before each engine step;
    `kvbatch worker` checks it at start-up (SettingError names a bad value)."""
    return float(env_number("KVBATCH_STEP_DELAY", 0.0, kind=float, minimum=0, unit="seconds"))


def _slowed(should_stop):
    delay = step_delay()
    if delay <= 0:
        return should_stop

    def slowed() -> bool:
        time.sleep(delay)
        return should_stop()

    return slowed


def _count_written(msg, status: str, job) -> None:
    """Count a shard given up on (cancelled, poisoned, failed); its lines only when this
    delivery wrote its result (`job` is None otherwise). Metrics never fail a shard."""
    lines = None
    if job is not None:
        try:
            records = [(0, line) for line in read_shard_result(job, msg.shard_id)]
            lines = metrics.lines_by_status(records)
        except Exception:
            log.debug("counting the lines of %s/%s failed", msg.job_id, msg.shard_id, exc_info=True)
    metrics.shard_finished(msg.job_id, status, lines)


def _parse(output: str, shard: dict):
    """The checked message and its job folder; a malformed message is rejected for good."""
    try:
        if not isinstance(output, str) or not output:
            raise ValueError(f"output prefix {output!r} is not a URI")
        if is_relative_path(output):
            raise ValueError(
                f"output prefix {output!r} is a relative path: it named a folder under the "
                f"submitter's working folder, not under this worker's ({os.getcwd()}); "
                "resubmit the job with an absolute --output or an s3:// prefix"
            )
        msg = ShardMessage.from_dict(shard)
        job = job_dir(output, msg.job_id)
        expected = job.join("shards", f"{msg.shard_id}.jsonl").uri
        if msg.uri != expected:
            raise ValueError(f"shard uri {msg.uri!r} is not under the job folder {expected!r}")
    except (ValueError, StorageError) as e:
        log.error("rejecting a malformed shard message: %s", e)
        raise Reject(str(e), requeue=False) from e
    return msg, job

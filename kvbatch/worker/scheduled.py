"""Scheduled runs: `kvbatch.scheduled_run(name, run_key)` prepares and enqueues one run of a
schedule entry (worker/schedule.py). An `index` entry only sends one task to the index worker
(worker/index_trigger.py); the steps below are those of an `input` entry.

A run is keyed by its date: its job id is `<name>-<YYYY-MM-DD>`, so a duplicate trigger (two
beats, a redelivered message, a manual rerun) finds `<output>/<job id>/job.json` and does
nothing. The steps:

1. input: the entry's JSONL as it is (documents go through an `index` entry instead).
2. kvbatch.jobs.distributed.submit.prepare_job(..., job_id=<name>-<date>); JobError because the job exists -> None.
3. `<output>/runs/<name>-<date>.json` records the run with `sent: false`; one message per shard
   (kvbatch.broker.send.send_shard); then `sent: true`. A trigger that finds job.json but not
   `sent: true` (a send failed part-way) sends the shards that have no attempt or result yet;
   the scheduled task itself retries the same date a few times after such a failure.
"""

from __future__ import annotations

import datetime as dt
import json
import logging

from kvbatch.jobs.storage import absolute_location, open_storage
from kvbatch.worker.index_trigger import trigger_index_run
from kvbatch.worker.schedule import IndexEntry, Schedule, ScheduleEntry

SCHEDULED_TASK = "kvbatch.scheduled_run"
SCHEDULED_QUEUE = "kvbatch-scheduled"  # consumed by `kvbatch beat` itself, not by GPU workers

log = logging.getLogger("kvbatch.scheduled")


def run_id(name: str, run_date: dt.date) -> str:
    return f"{name}-{run_date.isoformat()}"


def start_scheduled_run(
    entry: ScheduleEntry | IndexEntry, run_date: dt.date, *, app=None
) -> str | None:
    """Prepare and enqueue the run of `entry` for `run_date`; its job id, or None when that
    date's run already exists (a duplicate trigger) or there is nothing new to run."""
    from kvbatch.jobs.distributed.shards import job_dir
    from kvbatch.jobs.distributed.submit import prepare_job
    from kvbatch.jobs.local.run import JobError

    if isinstance(
        entry, IndexEntry
    ):  # one task message to the index worker (worker/index_trigger.py)
        return trigger_index_run(entry, run_date, app or _default_app())
    job_id = run_id(entry.name, run_date)
    job = job_dir(entry.output, job_id)  # validates the key part
    out = open_storage(entry.output)
    if job.join("job.json").exists():
        if _run_record(out, job_id).get("sent", True):
            log.info("scheduled %s: run %s exists; nothing to do", entry.name, job_id)
            return None
        return _resend(entry, job, job_id, out, app)
    input_uri = entry.input
    try:
        submitted = prepare_job(
            input_uri,
            entry.output,
            entry.model,
            model_name=entry.model_name,
            shard_tokens=entry.shard_tokens,
            job_id=job_id,
            max_attempts=entry.max_attempts,
        )
    except JobError:
        if job.join("job.json").exists():  # a concurrent trigger won the race
            log.info("scheduled %s: run %s was created concurrently", entry.name, job_id)
            return None
        raise
    record = {
        "job_id": job_id,
        "input": input_uri,
        "shards": len(submitted.messages),
        "requests": submitted.num_requests,
        "sent": False,  # True once every shard's message is sent
    }
    # The record first (with sent: False): if a send fails, a later trigger of the same date
    # finds it and sends what is missing (_resend) instead of doing nothing.
    _write_run_record(out, record)
    _send(entry, job, submitted.messages, app)
    _write_run_record(out, {**record, "sent": True})
    log.info(
        "scheduled %s: job %s, %d requests in %d shards",
        entry.name, job_id, submitted.num_requests, len(submitted.messages),
    )  # fmt: skip
    return job_id


def _run_record(out, job_id: str) -> dict:
    """runs/<job_id>.json, or {"sent": False} when it is missing (job.json was written, the
    run record was not: the run stopped before its sends)."""
    try:
        with out.join("runs", f"{job_id}.json").open_read() as f:
            return json.loads(f.read())
    except Exception:
        return {"sent": False}


def _write_run_record(out, record: dict) -> None:
    target = out.join("runs", f"{record['job_id']}.json")
    target.write_bytes(json.dumps(record, indent=2).encode() + b"\n")


def _default_app():
    from kvbatch.worker.app import broker_url, make_app

    return make_app(broker_url())


def _send(entry: ScheduleEntry, job, messages, app) -> None:
    """One message per shard, then finalize a job with nothing to run."""
    if app is None:
        app = _default_app()
    from kvbatch.broker.send import send_shard
    from kvbatch.broker.sqs import ensure_queue

    if messages:
        ensure_queue(app, entry.queue)
    for msg in messages:  # an absolute prefix: the workers run in other folders than beat
        send_shard(app, absolute_location(entry.output), msg, entry.queue)
    if not messages:
        from kvbatch.jobs.distributed.finalize import try_finalize

        try_finalize(job)


def _resend(entry: ScheduleEntry, job, job_id: str, out, app) -> str:
    """Send again the shards of a run whose sends failed part-way: every shard that has no
    result and no attempt yet (one already sent and still queued is sent twice; its second
    delivery finds the result and does nothing)."""
    from kvbatch.broker.resend import unwritten_shards
    from kvbatch.jobs.distributed.finalize import read_manifest

    manifest = read_manifest(job)
    started = {k.split("/", 1)[1].rsplit(".", 1)[0] for k in job.list("attempts/")}
    messages = unwritten_shards(job, manifest, skip=started)
    log.warning("scheduled %s: run %s was not fully sent; sending %d shards again",
                entry.name, job_id, len(messages))  # fmt: skip
    record = _run_record(out, job_id)
    record = {"job_id": job_id, "input": manifest["input"], "shards": len(manifest["shards"]),
              "requests": manifest["num_requests"], **record}  # fmt: skip
    _send(entry, job, messages, app)
    _write_run_record(out, {**record, "sent": True})
    return job_id


def run_date_now(schedule: Schedule, now: dt.datetime | None = None) -> dt.date:
    """Today in the schedule's time zone: the key of a run triggered now."""
    from zoneinfo import ZoneInfo

    now = now or dt.datetime.now(dt.timezone.utc)
    return now.astimezone(ZoneInfo(schedule.timezone)).date()


def register_scheduled(app, schedule: Schedule) -> None:
    """Register `kvbatch.scheduled_run` on `app` and set its beat schedule from `schedule`:
    one entry per job, its cron as a crontab, sent to SCHEDULED_QUEUE."""

    @app.task(name=SCHEDULED_TASK, bind=True, acks_late=True)
    def scheduled_run(self, name: str, run_key: str | None = None) -> str | None:
        entry = schedule.entry(name)
        run_date = dt.date.fromisoformat(run_key) if run_key else run_date_now(schedule)
        try:
            return start_scheduled_run(entry, run_date, app=app)
        except Exception as e:  # e.g. the broker away while sending: try the same date again
            log.warning("scheduled %s: run %s failed (%s); retrying", name, run_date, e)
            raise self.retry(
                exc=e, args=(name, run_date.isoformat()), countdown=60, max_retries=5
            ) from e

    app.conf.timezone = schedule.timezone
    app.conf.enable_utc = True
    app.conf.beat_schedule = {
        f"kvbatch-{e.name}": {
            "task": SCHEDULED_TASK,
            "schedule": e.crontab(),
            "args": (e.name,),
            "options": {"queue": SCHEDULED_QUEUE},
        }
        for e in schedule.jobs
    }


def beat(args) -> int:
    """`kvbatch beat`: celery beat with the schedule, embedded in a one-process worker that
    consumes SCHEDULED_QUEUE, so the runs are prepared here (tokenizer only, no GPU) and only
    their shards reach the GPU workers. Run exactly one per stack."""
    import sys

    from kvbatch.worker.app import BrokerError, broker_url, make_app
    from kvbatch.worker.schedule import ScheduleError, load_schedule

    try:
        schedule = load_schedule(args.schedule)
        app = make_app(broker_url(args.broker))
    except (ScheduleError, BrokerError) as e:
        print(f"kvbatch beat: {e}", file=sys.stderr)
        return 1
    register_scheduled(app, schedule)
    for e in schedule.jobs:
        where = f"index {e.index} (kvbatch index-worker)" if isinstance(e, IndexEntry) else e.output
        print(f"kvbatch beat: {e.name}: {e.cron} ({schedule.timezone}) -> {where}",
              file=sys.stderr)  # fmt: skip
    app.worker_main(
        [
            "worker",
            "--beat",
            f"--schedule={args.state}",
            "--pool=solo",
            "--concurrency=1",
            f"--loglevel={args.loglevel}",
            "-Q",
            SCHEDULED_QUEUE,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )
    return 0


def add_beat_args(p) -> None:
    import os
    import tempfile

    p.add_argument("--schedule", required=True, help="the schedule file (.toml or .yaml)")
    p.add_argument("--broker", help="redis://, rediss:// or sqs:// (default: KVBATCH_BROKER_URL)")
    p.add_argument(
        "--state",
        default=os.path.join(tempfile.gettempdir(), "kvbatch-beat-schedule"),
        help="celery beat's state file (last run times); keep it on a volume",
    )
    p.add_argument(
        "--loglevel",
        default="INFO",
        help="celery's log level for beat and its worker: DEBUG, INFO, WARNING or ERROR "
        "(default INFO)",
    )

"""A scheduled index run, beat's half: one Celery task message per run, nothing else.

Beat holds no model and must not block, so the trigger of an `index` entry of a schedule
(worker/schedule.py) only sends `kvbatch.index_run` (JSON arguments: the spec's path, the run
key, the entry's name and queues) to INDEX_QUEUE; a `kvbatch index-worker` there runs the
index as `kvbatch index --broker` does (worker/index_run.py): its stage jobs go to the
workers of each model's queue, and it waits for them and merges once.

A run is keyed by its date. Its record, `<runs>/scheduled/<name>-<YYYY-MM-DD>.json` under the
spec's run folder, is claimed once (write_if_absent) with `sent: false`, then `sent: true`
once the message is sent; the index worker adds `status: "merged"` or `"up to date"`, the
run id and the report. A duplicate trigger (two beats, a redelivered message, a manual
rerun) finds a sent record and does nothing; one that finds `sent: false` (the send failed
after the claim) sends again.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from kvbatch.index.spec import IndexSpec, load_spec
from kvbatch.jobs.storage import Storage, open_storage
from kvbatch.metrics_registry import metrics_port
from kvbatch.worker.schedule import IndexEntry

INDEX_TASK = "kvbatch.index_run"
INDEX_QUEUE = "kvbatch-index"  # consumed by `kvbatch index-worker` (no model, no GPU)

log = logging.getLogger("kvbatch.scheduled")


@dataclass(frozen=True)
class IndexRunRequest:
    """The task's arguments, all JSON: what the index worker needs to run the entry."""

    spec: str  # the index spec's absolute path
    run_key: str  # YYYY-MM-DD
    name: str  # the schedule entry
    generation_queue: str | None = None
    embedding_queue: str | None = None
    shard_tokens: int = 200_000

    def __post_init__(self) -> None:
        dt.date.fromisoformat(self.run_key)  # ValueError: not a run date; it names a file

    def to_kwargs(self) -> dict:
        return dict(self.__dict__)


def run_record(spec: IndexSpec, name: str, run_key: str) -> Storage:
    """The run's record under the spec's run folder (names checked as one key part each)."""
    return open_storage(spec.output.runs).join("scheduled", f"{name}-{run_key}.json")


def read_record(target: Storage) -> dict | None:
    if not target.exists():
        return None
    with target.open_read() as f:
        return json.loads(f.read())


def trigger_index_run(entry: IndexEntry, run_date: dt.date, app) -> str | None:
    """Send the run of index entry `entry` for `run_date` (its record's name), or None when
    that date's run was already sent."""
    path = str(Path(entry.index).resolve())
    spec = load_spec(path)  # a spec error stops the trigger here, named, before any message
    request = IndexRunRequest(
        spec=path,
        run_key=run_date.isoformat(),
        name=entry.name,
        generation_queue=entry.generation_queue,
        embedding_queue=entry.embedding_queue,
        shard_tokens=entry.shard_tokens,
    )
    target = run_record(spec, entry.name, request.run_key)
    record = {**request.to_kwargs(), "sent": False}
    if not target.write_if_absent(json.dumps(record, indent=2).encode() + b"\n"):
        if (read_record(target) or {}).get("sent", True):
            log.info("scheduled %s: run %s exists; nothing to do", entry.name, request.run_key)
            return None
        log.warning("scheduled %s: run %s was not sent; sending it", entry.name, request.run_key)
    app.send_task(INDEX_TASK, kwargs=request.to_kwargs(), queue=INDEX_QUEUE)
    target.write_bytes(json.dumps({**record, "sent": True}, indent=2).encode() + b"\n")
    log.info("scheduled %s: index run %s sent to %s", entry.name, request.run_key, INDEX_QUEUE)
    return f"{entry.name}-{request.run_key}"


def add_index_worker_args(p) -> None:
    """`kvbatch index-worker`'s flags (here: the parser is built without importing torch)."""
    p.add_argument("--broker", help="redis://, rediss:// or sqs:// (default: KVBATCH_BROKER_URL)")
    p.add_argument(
        "--queue",
        default=INDEX_QUEUE,
        help=f"the queue of scheduled index runs (default {INDEX_QUEUE})",
    )
    p.add_argument(
        "--loglevel", default="INFO", help="Celery's log level: DEBUG, INFO, WARNING (default INFO)"
    )
    p.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=9401,
        help="serve Prometheus metrics of the index runs per stage on this port (0: off)",
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="address for --metrics-port")

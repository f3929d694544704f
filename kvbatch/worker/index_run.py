"""A scheduled index run, the index worker's half: `kvbatch index-worker` consumes INDEX_QUEUE
and runs each `kvbatch.index_run` task as `kvbatch index SPEC --broker` runs (its stage jobs on
the workers of each model's queue; this process holds no model), then writes the outcome into
the run's record (worker/index_trigger.py).

The task is acknowledged when it starts (acks_late off): a run lasts as long as its stage jobs,
far beyond a broker's visibility timeout, and a redelivery while it runs would start a second
orchestrator of the same run. An index worker killed mid-run leaves the record sent without a
status; `kvbatch index SPEC --broker URL` by hand (or the next night's run, which plans every
change since the last merge) finishes the work: the same plan finds the same run folder and
its stage jobs. A task whose record already holds a status (a duplicate message) does nothing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys

from celery import Celery

from kvbatch.index.distributed import DistributedStages
from kvbatch.index.metrics import process_metrics
from kvbatch.index.pipeline import run_index
from kvbatch.index.spec import load_spec
from kvbatch.worker.index_trigger import (
    INDEX_TASK,
    IndexRunRequest,
    read_record,
    run_record,
)
from kvbatch.worker.metrics import start_metrics_server

log = logging.getLogger("kvbatch.scheduled")


def run_scheduled_index(app: Celery, request: IndexRunRequest) -> dict:
    """Run the index of `request` on the workers; the record's status afterwards."""
    spec = load_spec(request.spec)
    target = run_record(spec, request.name, request.run_key)
    record = read_record(target) or {**request.to_kwargs(), "sent": True}
    if record.get("status"):
        log.info("scheduled %s: run %s already %s", request.name, request.run_key,
                 record["status"])  # fmt: skip
        return record
    queues = {}
    if request.generation_queue and spec.models.generation:
        queues[spec.models.generation] = request.generation_queue
    if request.embedding_queue:
        queues[spec.models.embedding] = request.embedding_queue
    metrics = process_metrics()
    stages = DistributedStages(app, queues, shard_tokens=request.shard_tokens)
    stages.on_progress = lambda p: metrics.progress(p.stage, p.status)
    report = run_index(spec, stages=stages, metrics=metrics)
    record = {
        **record,
        "status": "merged" if report.wrote else "up to date",
        "run_id": report.run_id,
        "report": report.to_dict(),
    }
    target.write_bytes(json.dumps(record, indent=2).encode() + b"\n")
    log.info("scheduled %s: run %s %s (%s, %d chunks)", request.name, request.run_key,
             record["status"], report.run_id or "-", report.chunks)  # fmt: skip
    return record


def register_index_task(app: Celery) -> None:
    """`kvbatch.index_run` on `app`: JSON keyword arguments (IndexRunRequest's fields)."""

    @app.task(name=INDEX_TASK, acks_late=False)
    def index_run(**kwargs) -> dict:
        return run_scheduled_index(app, IndexRunRequest(**kwargs))


def index_worker(args) -> int:
    """`kvbatch index-worker`: a one-process Celery worker on INDEX_QUEUE (or --queue)."""
    from kvbatch.worker.app import BrokerError, broker_url, make_app, run_solo_worker

    logging.basicConfig(level=logging.WARNING, format="kvbatch: %(message)s", stream=sys.stderr)
    logging.getLogger("kvbatch").setLevel(logging.INFO)
    try:
        app = make_app(broker_url(args.broker))
    except BrokerError as e:
        print(f"kvbatch index-worker: {e}", file=sys.stderr)
        return 1
    register_index_task(app)
    if args.metrics_port:
        try:  # a busy port costs the metrics, not the runs
            start_metrics_server(args.metrics_port, args.metrics_host)
        except OSError as e:
            log.warning("no metrics: cannot serve %s:%d (%s)", args.metrics_host,
                        args.metrics_port, e)  # fmt: skip
    name = f"kvbatch-index-{os.getpid()}@{socket.gethostname()}"
    run_solo_worker(app, args.queue, args.loglevel, name)
    return 0

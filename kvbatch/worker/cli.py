"""`kvbatch submit`, `kvbatch worker` and `kvbatch finalize`: the distributed commands.

kvbatch submit INPUT --output URI --model PATH [--broker URL] [--shard-tokens N]
    validate, tokenize and shard the input into <URI>/<job_id>/, send one message per
    shard; the job id is the last line printed
kvbatch worker --model PATH [--broker URL] [--queue Q] [--device ...] [--metrics-port N]
               [--metrics-host ADDR]
        [--speculative ngram|draft:PATH] [--num-speculative-tokens K]
    load the model once, then run shards until stopped (solo pool: one process per GPU);
    Prometheus metrics on port N (default 9400, 0: off; worker/metrics.py)
kvbatch finalize JOB --output URI
    assemble a job whose last shard's finalizer was lost; print its status
kvbatch status JOB --output URI [--json] [--watch [--interval S]]
    counts, tokens/s and ETA from the job folder (never imports torch or Celery)
kvbatch cancel JOB --output URI
    stop a job: running shards stop between engine steps, pending ones are skipped,
    finished lines are kept (jobs/distributed/cancel.py)
kvbatch resend JOB --output URI [--broker URL] [--queue Q] [--unwritten]
    send again the shards the broker lost (Redis: no result and no message in the queue or
    unacknowledged); --unwritten: every shard without a result (broker/resend.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys

from kvbatch.broker.settings import DEFAULT_QUEUE  # plain Python: no Celery to parse arguments
from kvbatch.engine import EngineArgs  # plain Python: no torch to parse arguments
from kvbatch.env_settings import SettingError
from kvbatch.jobs.context_flags import as_flags
from kvbatch.metrics_registry import metrics_port
from kvbatch.redact import redact_url, redact_urls

log = logging.getLogger("kvbatch.worker")
DEFAULTS = EngineArgs()  # the engine's defaults, for the flags below


def _count(power_of_two: bool = False):
    """argparse type of a count >= 1 (a power of two if asked): `--shard-tokens 0` or
    `--block-size 3` stops at parsing, not after the broker is reached and the input read."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
        if power_of_two and value & (value - 1):
            raise argparse.ArgumentTypeError(f"must be a power of two (e.g. 16), got {text}")
        return value

    return parse


def add_submit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="JSONL file or s3://bucket/key")
    p.add_argument("--output", required=True, help="prefix (folder or s3://) for the job folder")
    p.add_argument(
        "--model",
        required=True,
        help="the workers' model, for its tokenizer: a Hugging Face folder, a .gguf file or a "
        "Hub id (owner/name)",
    )
    p.add_argument("--model-name", help="the job's model name (default: the first line's)")
    p.add_argument("--broker", help="redis://, rediss:// or sqs:// (default: KVBATCH_BROKER_URL)")
    p.add_argument(
        "--queue",
        default=DEFAULT_QUEUE,
        help=f"the queue the workers read (default {DEFAULT_QUEUE})",
    )
    p.add_argument("--shard-tokens", type=_count(), default=200_000, help="prompt tokens per shard")
    p.add_argument(
        "--block-size",
        type=_count(power_of_two=True),
        default=DEFAULTS.block_size,
        help=f"the workers' KV block size, a power of two (default {DEFAULTS.block_size})",
    )
    p.add_argument(
        "--max-model-len",
        type=_count(),
        default=None,
        help="the workers' --max-model-len: longer requests are errors (default: the model's; "
        "a worker without one caps it at what its KV cache holds)",
    )
    p.add_argument("--max-attempts", type=_count(), default=3, help="deliveries of a shard at most")
    p.add_argument("--job-id", help="default: job-<UTC time>-<random>")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="a Hugging Face folder, a .gguf file or a Hub id (owner/name), fetched once per "
        "machine into the Hugging Face cache",
    )
    p.add_argument("--broker", help="redis://, rediss:// or sqs:// (default: KVBATCH_BROKER_URL)")
    p.add_argument(
        "--queue",
        default=DEFAULT_QUEUE,
        help=f"the queue to take shards from (default {DEFAULT_QUEUE})",
    )
    p.add_argument("--concurrency", type=int, help="ignored: always one process (solo pool)")
    p.add_argument(
        "--loglevel", default="INFO", help="Celery's log level: DEBUG, INFO, WARNING (default INFO)"
    )
    p.add_argument(
        "--metrics-port",
        type=metrics_port,
        default=9400,
        help="serve Prometheus metrics on this port (0: off)",
    )
    p.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        help="address the metrics port binds (default 0.0.0.0: reachable by a Prometheus "
        "scraping the container or host from outside; 127.0.0.1 keeps it local)",
    )


def add_finalize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", help="the job id `kvbatch submit` printed last")
    p.add_argument("--output", required=True, help="the prefix the job was submitted to")
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def add_status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", help="the job id `kvbatch submit` printed last")
    p.add_argument("--output", required=True, help="the prefix the job was submitted to")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument("--watch", action="store_true", help="refresh until the job is finished")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes")
    p.add_argument(
        "--max-refreshes", type=int, default=100_000, help="stop watching after this many"
    )


def add_cancel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", help="the job id `kvbatch submit` printed last")
    p.add_argument("--output", required=True, help="the prefix the job was submitted to")


def add_resend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", help="the job id `kvbatch submit` printed last")
    p.add_argument("--output", required=True, help="the prefix the job was submitted to")
    p.add_argument("--broker", help="redis://, rediss:// or sqs:// (default: KVBATCH_BROKER_URL)")
    p.add_argument(
        "--queue",
        default=DEFAULT_QUEUE,
        help=f"the queue the job was submitted to (default {DEFAULT_QUEUE})",
    )
    p.add_argument(
        "--unwritten",
        action="store_true",
        help="send every shard that has no result, not only those the broker lost "
        "(needed on SQS, whose queue cannot be listed; a shard sent twice is still answered once)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds between the two reads of the Redis queue (a shard missing from both is lost)",
    )


def _app(args: argparse.Namespace, command: str):
    """The Celery app on `--broker` (or KVBATCH_BROKER_URL), or None after printing why not."""
    from kvbatch.worker.app import BrokerError, broker_url, make_app

    try:
        return make_app(broker_url(args.broker))
    except BrokerError as e:
        print(f"kvbatch {command}: {e}", file=sys.stderr)
        return None


def _where(app) -> str:
    """The app's broker URL for a message: its password masked (plain string work: kombu's
    sanitize_url raises on a URL it cannot parse, inside the handler that reports it)."""
    return redact_url(str(app.conf.broker_url))


def _broker_error(e: Exception, app) -> str:
    """A transport's error text, with the broker URL's credentials masked wherever it says
    them."""
    return redact_urls(str(e), str(app.conf.broker_url))


def submit(args: argparse.Namespace) -> int:
    from kvbatch.broker.send import send_shard
    from kvbatch.jobs.distributed.submit import prepare_job
    from kvbatch.jobs.local.run import JobError
    from kvbatch.jobs.local.scan_progress import ScanProgress

    app = _app(args, "submit")
    if app is None:
        return 1
    # The broker first: an unreachable broker must not leave a job folder nobody will run.
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as e:  # kombu raises the transport's own errors (redis, botocore, ...)
        print(
            f"kvbatch submit: cannot reach the broker {_where(app)}: {_broker_error(e, app)}",
            file=sys.stderr,
        )
        return 1
    try:
        from kvbatch.broker.sqs import ensure_queue

        ensure_queue(app, args.queue)  # SQS: the queue and its dead-letter queue; Redis: no-op
    except Exception as e:
        print(f"kvbatch submit: cannot create the queue {args.queue}: {e}", file=sys.stderr)
        return 1
    try:
        job = prepare_job(
            args.input,
            args.output,
            args.model,
            model_name=args.model_name,
            shard_tokens=args.shard_tokens,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            job_id=args.job_id,
            max_attempts=args.max_attempts,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            progress=ScanProgress(None),  # lines tokenized and an ETA, on stderr
        )
    except JobError as e:
        print(f"kvbatch submit: {e}", file=sys.stderr)
        return 1
    try:
        for msg in job.messages:
            send_shard(app, job.output, msg, args.queue)
    except Exception as e:
        from kvbatch.jobs.distributed.finalize import mark_job_failed
        from kvbatch.jobs.distributed.shards import job_dir

        reason = f"sending the shards to the broker failed: {e}; resubmit the input"
        try:  # the job can never finish: say so in its batch.json (and kvbatch status)
            mark_job_failed(job_dir(args.output, job.job_id), "send_failed", reason)
        except Exception as mark_error:
            reason += f" (marking the job failed failed too: {mark_error})"
        print(f"kvbatch submit: job {job.job_id} at {job.dir_uri}: {reason}", file=sys.stderr)
        return 1
    if not job.messages:  # every line was invalid: nothing to run, finalize now
        from kvbatch.jobs.distributed.finalize import try_finalize
        from kvbatch.jobs.distributed.shards import job_dir

        try_finalize(job_dir(args.output, job.job_id))
    print(
        f"kvbatch submit: {job.num_requests} requests in {len(job.messages)} shards, "
        f"{job.num_invalid} invalid lines; job folder {job.dir_uri}",
        file=sys.stderr,
    )
    print(job.job_id)
    return 0


def worker(args: argparse.Namespace, engine: dict) -> int:
    from kvbatch.broker.settings import TASK_NAME
    from kvbatch.worker.app import run_solo_worker
    from kvbatch.worker.tasks import WorkerModel, step_delay

    logging.basicConfig(level=logging.WARNING, format="kvbatch: %(message)s", stream=sys.stderr)
    logging.getLogger("kvbatch").setLevel(logging.INFO)
    app = _app(args, "worker")
    if app is None:
        return 1
    try:  # read per shard: a bad value is named here, before any model loads
        step_delay()
    except SettingError as e:
        print(f"kvbatch worker: {e}", file=sys.stderr)
        return 1
    model = WorkerModel(args.model, engine)
    try:
        model.llm()  # once, before taking any shard; a bad model fails here, not per shard
        # jobs submitted for another checkpoint are left to other workers (worker/tasks.py)
        log.info("model fingerprint %s", model.fingerprint().digest)
    except (OSError, ValueError) as e:
        print(f"kvbatch worker: cannot load the model: {as_flags(str(e))}", file=sys.stderr)
        return 1
    app.tasks[TASK_NAME].use_model(model)
    try:
        from kvbatch.broker.sqs import ensure_queue

        ensure_queue(app, args.queue)  # SQS: the queue and its dead-letter queue; Redis: no-op
    except Exception as e:
        print(f"kvbatch worker: cannot create the queue {args.queue}: {e}", file=sys.stderr)
        return 1
    port = getattr(args, "metrics_port", 0)
    host = getattr(args, "metrics_host", "0.0.0.0")
    if port:
        from kvbatch.worker.metrics import observe_engine, start_metrics_server

        try:  # a busy port (two workers on one host) costs the metrics, not the worker
            start_metrics_server(port, host)
        except OSError as e:
            log.warning(
                "no metrics: cannot serve %s:%d (%s); give --metrics-host/--metrics-port",
                host,
                port,
                e,
            )
        else:
            observe_engine(model.llm())
            log.info("metrics on %s:%d/metrics", host, port)
    hostname = f"kvbatch-{os.getpid()}@{socket.gethostname()}"
    run_solo_worker(app, args.queue, args.loglevel, hostname)
    return 0


def finalize(args: argparse.Namespace) -> int:
    from kvbatch.jobs.distributed.finalize import job_status, try_finalize
    from kvbatch.jobs.distributed.shards import job_dir
    from kvbatch.jobs.storage import StorageError

    try:
        job = job_dir(args.output, args.job_id)
        if not job.join("job.json").exists():
            print(f"kvbatch finalize: no job {args.job_id!r} under {args.output}", file=sys.stderr)
            return 1
        try_finalize(job)
        status = job_status(job)
    except (ValueError, StorageError) as e:
        print(f"kvbatch finalize: {e}", file=sys.stderr)
        return 1
    status.update(_locations(job, status))
    if args.json:
        print(json.dumps(_jsonable(status), indent=2))
    else:
        print(format_status(status))
    return 0


FINAL = ("completed", "cancelled", "failed", "expired")


def status(args: argparse.Namespace) -> int:
    import time

    if args.interval <= 0:
        print("kvbatch status: --interval must be positive", file=sys.stderr)
        return 2
    refreshes = 0
    shown = 0  # lines of the block on screen, rewritten in place on a terminal
    in_place = args.watch and not args.json and sys.stdout.isatty()
    try:
        while True:
            current = _read_status(args.output, args.job_id)
            if current is None:
                return 1
            if args.json:
                print(json.dumps(current, indent=None if args.watch else 2), flush=True)
            else:
                block = format_status(current)
                if in_place and shown:
                    print(f"\x1b[{shown}F\x1b[J", end="")  # up to the block's start, clear
                print(block, flush=True)
                shown = block.count("\n") + 1
            refreshes += 1
            if not args.watch or current["status"] in FINAL or refreshes >= args.max_refreshes:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 130


def _read_status(output: str, job_id: str) -> dict | None:
    from kvbatch.jobs.distributed.finalize import job_status
    from kvbatch.jobs.distributed.shards import job_dir
    from kvbatch.jobs.storage import StorageError

    try:
        job = job_dir(output, job_id)
        if not job.join("job.json").exists():
            print(f"kvbatch status: no job {job_id!r} under {output}", file=sys.stderr)
            return None
        status = job_status(job)
        status.update(_locations(job, status))
        return status
    except (ValueError, StorageError) as e:
        print(f"kvbatch status: {e}", file=sys.stderr)
        return None


def _locations(job, status: dict) -> dict:
    """Where the job's files are: its folder, and the merged answers once there are some."""
    where = {"job_dir": job.uri}
    if status["status"] in ("completed", "cancelled"):
        where["output_file"] = job.join("output.jsonl").uri
        where["errors_file"] = job.join("errors.jsonl").uri
    return where


def format_status(s: dict) -> str:
    """The status as a small human table."""

    def seconds(x):
        if x is None:
            return "-"
        x = int(x)
        return (
            f"{x // 3600}h{x % 3600 // 60:02d}m{x % 60:02d}s"
            if x >= 3600
            else (f"{x // 60}m{x % 60:02d}s" if x >= 60 else f"{x}s")
        )

    running = s.get("running_finished", 0)
    done = s["completed"] + s["failed"] + running
    rows = [
        ("job", s["job_id"]),
        ("status", s["status"]),
        ("shards", f"{s['shards_done']} / {s['shards_total']} written"),
        (
            "requests",
            f"{done} / {s['requests']} done ({running} in running shards, {s['invalid']} "
            "invalid lines)",
        ),
        ("completed", str(s["completed"])),
        ("failed", f"{s['failed']} ({s['cancelled']} cancelled)"),
        ("output tokens", str(s["output_tokens"])),
        ("tokens/s", "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.1f}"),
        ("elapsed", seconds(s["elapsed_s"])),
        ("eta", seconds(s["eta_s"])),
    ]
    if s.get("job_dir"):
        rows.append(("folder", s["job_dir"]))
    if s.get("output_file"):
        rows += [("answers", s["output_file"]), ("errors", s["errors_file"])]
        prefix = s["job_dir"].removesuffix("/").rsplit("/", 1)[0]
        rows.append(("fetch", f"kvbatch results {s['job_id']} --output {prefix} -o FILE"))
    failures = s.get("shard_failures") or {}
    rows += [(f"shard {k}", f"last failure: {v}") for k, v in failures.items()]
    rows += [(f"shard {k}", f"waiting: {v}") for k, v in (s.get("shard_waits") or {}).items()]
    if s.get("hint") and s["status"] == "in_progress":
        rows.append(("hint", s["hint"]))
    rows += [("error", e) for e in s.get("errors") or []]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cancel(args: argparse.Namespace) -> int:
    from kvbatch.jobs.distributed.cancel import cancel_job
    from kvbatch.jobs.distributed.shards import job_dir
    from kvbatch.jobs.storage import StorageError

    try:
        job = job_dir(args.output, args.job_id)
        if not job.join("job.json").exists():
            print(f"kvbatch cancel: no job {args.job_id!r} under {args.output}", file=sys.stderr)
            return 1
        result = cancel_job(job)
    except (ValueError, StorageError) as e:
        print(f"kvbatch cancel: {e}", file=sys.stderr)
        return 1
    if result.status == "completed" and not result.changed:
        print(f"kvbatch cancel: job {args.job_id} had already completed; nothing changed")
    elif not result.changed:
        print(f"kvbatch cancel: job {args.job_id} was already cancelled ({result.status})")
    else:
        print(
            f"kvbatch cancel: job {args.job_id} {result.status}; {result.skipped_shards} pending "
            "shards skipped, running ones stop between engine steps"
        )
    return 0


def resend(args: argparse.Namespace) -> int:
    from kvbatch.broker.resend import ResendError, resend
    from kvbatch.jobs.distributed.finalize import read_manifest
    from kvbatch.jobs.distributed.shards import job_dir
    from kvbatch.jobs.storage import StorageError, absolute_location

    if args.settle < 0:
        print("kvbatch resend: --settle must be 0 or more seconds", file=sys.stderr)
        return 2
    app = _app(args, "resend")
    if app is None:
        return 1
    try:
        job = job_dir(args.output, args.job_id)
        if not job.join("job.json").exists():
            print(f"kvbatch resend: no job {args.job_id!r} under {args.output}", file=sys.stderr)
            return 1
        result = resend(
            app, args.queue, absolute_location(args.output), job, read_manifest(job),
            unwritten=args.unwritten, settle=args.settle,
        )  # fmt: skip
    except (ResendError, ValueError, StorageError) as e:
        print(f"kvbatch resend: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # kombu raises the transport's own errors (redis, botocore, ...)
        print(
            f"kvbatch resend: cannot read or write the broker {_where(app)}: "
            f"{_broker_error(e, app)}",
            file=sys.stderr,
        )
        return 1
    what = "without a result" if args.unwritten else "lost by the broker"
    print(
        f"kvbatch resend: job {args.job_id}: {result.written} of {result.shards} shards written; "
        f"{len(result.resent)} {what} sent again"
    )
    for shard_id in result.resent:
        print(shard_id)
    return 0


def _jsonable(status):
    if hasattr(status, "to_dict"):
        return status.to_dict()
    if hasattr(status, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(status)
    return status

"""`kvbatch results JOB --output PREFIX [-o FILE] [--errors]`: a distributed job's merged answers.

The answers of a job submitted to PREFIX live at PREFIX/JOB/output.jsonl (errors.jsonl
beside them) once every shard is written and the job is merged. This command merges it when
its shards are all done (the same step as `kvbatch finalize`, safe to repeat), then streams
the file to FILE (a path or s3:// URI; default '-', stdout), so a user needs neither the
storage layout nor an S3 client. A job still running is not an error to hide: it says how far
it is and how to follow it, and exits 3. Imports no torch and no Celery (its flags are in
kvbatch/cli.py, so that building the parser imports none of this).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from kvbatch.jobs.distributed.finalize import job_status, try_finalize
from kvbatch.jobs.distributed.shards import job_dir
from kvbatch.jobs.storage import StorageError, open_storage

NOT_FINISHED = 3  # exit status of a job that has no merged output yet


def results(args: argparse.Namespace) -> int:
    name = "errors.jsonl" if args.errors else "output.jsonl"
    try:
        job = job_dir(args.output, args.job_id)
        inside = inside_folder(args.to, job.uri)
        if inside:
            print(
                f"kvbatch results: -o {args.to} is inside the job's own folder {inside}, whose "
                "files (job.json, batch.json, the shards) the job needs: write the answers "
                "elsewhere",
                file=sys.stderr,
            )
            return 1
        if not job.join("job.json").exists():
            print(f"kvbatch results: no job {args.job_id!r} under {args.output}", file=sys.stderr)
            return 1
        try_finalize(job)
        source = job.join(name)
        if not source.exists():
            status = job_status(job)
            done = status["completed"] + status["failed"] + status.get("running_finished", 0)
            print(
                f"kvbatch results: job {args.job_id} is {status['status']}: {done} of "
                f"{status['requests']} requests answered, no {name} yet; follow it with "
                f"`kvbatch status {args.job_id} --output {args.output} --watch`",
                file=sys.stderr,
            )
            return NOT_FINISHED
        with source.open_read() as src, open_storage(args.to).open_write() as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (ValueError, StorageError) as e:
        print(f"kvbatch results: {e}", file=sys.stderr)
        return 1
    if args.to != "-":
        print(f"kvbatch results: {source.uri} -> {args.to}", file=sys.stderr)
    return 0


def inside_folder(target: str, folder: str) -> str | None:
    """`folder` (a job's folder: a local path or s3:// prefix), as compared, when `target`
    lies in it or is it; None otherwise. Local paths are compared resolved (symlinks, '..'),
    S3 keys as written (S3 has no '..'); '-' (stdout) is never inside."""
    if target == "-":
        return None
    if target.startswith("s3://") or folder.startswith("s3://"):
        base = folder.rstrip("/")
        return base if target == base or target.startswith(base + "/") else None
    base = os.path.realpath(folder.removeprefix("file://"))
    path = os.path.realpath(target.removeprefix("file://"))
    return base if path == base or path.startswith(base.rstrip(os.sep) + os.sep) else None

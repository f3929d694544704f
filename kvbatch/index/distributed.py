"""The model stages of `kvbatch index --broker URL` on the workers.

A stage's lines (folder/input.jsonl, written by the pipeline as on one machine) become a
distributed kvbatch job in the same folder: `<runs>/<run_id>/<stage>/` is the job's folder
(job id = the stage's name), its shards written once by submit's prepare_job and one pointer
message per shard sent to the queue of the model the stage needs. A generation worker and an
embedding worker are different processes (`kvbatch worker --model M --queue Q`), so each
model has its own queue: model_queue(M) unless the caller names one.

The runner then waits for the job to finish (the workers finalize it; this process finalizes
too once every shard has its result, in case the last finalizer died), logs its progress
from job_status, and reads output.jsonl and errors.jsonl as the local path reads its job's.
A run killed while waiting and started again finds the same run folder (the same plan): the
job is not submitted again; its shards without a result are sent again (a shard sent twice
is answered once: results are written once).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbatch.broker.resend import unwritten_shards
from kvbatch.broker.send import send_shard
from kvbatch.index.pipeline import IndexRunError, StageOutcome
from kvbatch.index.report import PrefillTokens
from kvbatch.index.stage_jobs import read_answers
from kvbatch.jobs.distributed.finalize import job_status, read_manifest, try_finalize
from kvbatch.jobs.distributed.shards import job_dir
from kvbatch.jobs.distributed.submit import prepare_job
from kvbatch.jobs.local.run import JobError
from kvbatch.jobs.storage import Storage

log = logging.getLogger("kvbatch.index")

FINAL = ("completed", "cancelled", "failed", "expired")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def model_queue(model: str) -> str:
    """The queue of a model's workers: `kvbatch-<the model's folder or file name>`, in the
    characters Redis and SQS queue names both take (SQS: at most 80)."""
    name = _UNSAFE.sub("-", Path(model.rstrip("/")).name).strip("-") or "model"
    return f"kvbatch-{name}"[:76]  # room for SQS's "-dlq"


@dataclass
class StageProgress:
    """One stage job's progress as the terminal shows it (from job_status)."""

    stage: str
    status: dict

    def line(self) -> str:
        s = self.status
        done = s["completed"] + s["failed"] + s.get("running_finished", 0)
        eta = "-" if s.get("eta_s") is None else f"{int(s['eta_s'])}s"
        return (
            f"{self.stage}: {s['status']}, shards {s['shards_done']}/{s['shards_total']}, "
            f"requests {done}/{s['requests']} ({s['failed']} failed), "
            f"output tokens {s['output_tokens']}, eta {eta}"
        )


@dataclass
class DistributedStages:
    """Runs each model stage as a distributed job on the workers of its model's queue."""

    app: object  # the Celery app on the broker
    queues: dict[str, str] = field(default_factory=dict)  # model -> queue; else model_queue
    shard_tokens: int = 200_000
    poll_s: float = 1.0
    on_progress: Callable[[StageProgress], None] | None = None
    timeout_s: float | None = None  # None: wait as long as the job runs

    def queue_for(self, model: str) -> str:
        return self.queues.get(model) or model_queue(model)

    def run(self, stage: str, run_folder: Storage, model: str, role: str) -> StageOutcome:
        queue = self.queue_for(model)
        folder = run_folder.join(stage)  # the stage's input.jsonl beside its job's files
        job = job_dir(run_folder.uri, stage)
        if job.join("job.json").exists():
            manifest = read_manifest(job)
            if not _final(job):
                resent = unwritten_shards(job, manifest)
                for msg in resent:
                    send_shard(self.app, run_folder.uri, msg, queue)
                log.info("%s: resumed job %s: %d shards sent again", stage, job.uri, len(resent))
        else:
            manifest = self._submit(stage, run_folder, model, role, queue)
        status = self._wait(stage, job)
        if status["status"] != "completed":
            raise IndexRunError(
                f"{stage}: the job at {job.uri} ended {status['status']}: "
                f"{'; '.join(status.get('errors') or []) or 'see kvbatch status'}"
            )
        answers = read_answers(folder, errors="errors.jsonl")
        prefill = None
        if stage == "generate":
            prefill = PrefillTokens(
                computed=answers.prompt_tokens - answers.cached_tokens,
                ideal=manifest["prompt_tokens"] - manifest["ideal_cached_tokens"],
                no_sharing=manifest["prompt_tokens"],
            )
        return StageOutcome(answers, prefill)

    def _submit(self, stage: str, run_folder: Storage, model: str, role: str, queue: str) -> dict:
        try:
            submitted = prepare_job(
                run_folder.join(stage, "input.jsonl").uri,
                run_folder.uri,
                model,
                shard_tokens=self.shard_tokens,
                job_id=stage,
            )
        except JobError as e:
            raise IndexRunError(f"models.{role}: {stage}: {e}") from e
        for msg in submitted.messages:
            send_shard(self.app, submitted.output, msg, queue)
        job = job_dir(run_folder.uri, stage)
        if not submitted.messages:  # every line invalid: nothing for a worker to finalize
            try_finalize(job)
        log.info(
            "%s: %d requests in %d shards sent to queue %s (kvbatch worker --model %s --queue %s)",
            stage,
            submitted.num_requests,
            len(submitted.messages),
            queue,
            model,
            queue,
        )
        return read_manifest(job)

    def _wait(self, stage: str, job) -> dict:
        start = time.monotonic()
        shown = None
        while True:
            status = job_status(job)
            if status["status"] not in FINAL and status["shards_done"] == status["shards_total"]:
                try_finalize(job)  # the last shard's finalizer may have died after its result
                status = job_status(job)
            progress = StageProgress(stage, status)
            if progress.line() != shown:
                shown = progress.line()
                log.info("%s", shown)
                if self.on_progress is not None:
                    self.on_progress(progress)
            if status["status"] in FINAL:
                return status
            if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                raise IndexRunError(
                    f"{stage}: the job at {job.uri} did not finish in {self.timeout_s:.0f} s: "
                    "are workers reading its queue? (run the command again to go on waiting)"
                )
            time.sleep(self.poll_s)


def _final(job) -> bool:
    return job_status(job)["status"] in FINAL

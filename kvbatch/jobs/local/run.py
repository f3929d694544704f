"""`kvbatch run`: one machine, no broker. Validate, group by prefix, run, write in input order.

    input.jsonl --validate--> requests + error records (line numbers)
      --chat template, tokenize (spilled to disk)--> token ids
      --prefix trie over the whole job--> depth-first order
      --engine, bounded window--> answers, committed in flushed batches (resumable)
      --finalize--> output.jsonl (input order), errors.jsonl, batch.json

Exit status (kvbatch.cli): 0 when at least one line was answered, 1 when every line failed
(at validation or in the engine); an error before any work (missing input, unwritable output,
unloadable model) raises JobError with one clear message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

from kvbatch.jobs.answering import EngineRequest, LineContext, answer
from kvbatch.jobs.context_flags import long_line_advice
from kvbatch.jobs.grouping import group_by_prefix
from kvbatch.jobs.local.finalize import finalize
from kvbatch.jobs.local.model_on_demand import ModelNotLoaded, ModelOnDemand, warn_missing_model
from kvbatch.jobs.local.options import (
    JobError,
    JobInterrupted,
    RunMonitor,
    RunOptions,
    job_identity,
)
from kvbatch.jobs.local.output_lock import OutputBusy, output_lock
from kvbatch.jobs.local.partial import PartialError, PartialOutput
from kvbatch.jobs.local.partial_claim import claim_partial
from kvbatch.jobs.local.paths import (
    JobPaths,
    holds_answers,
    interrupted_message,
    kept_message,
    local_path,
    refuse_one_file_twice,
    refuse_overwriting_the_input,
    resolve_paths,
)
from kvbatch.jobs.local.prepare import (
    PreparedJob,
    engine_params,
    line_digest,
    prepare_lines,
    prepare_requests,
)
from kvbatch.jobs.local.progress import Progress
from kvbatch.jobs.local.scan_progress import ScanProgress
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.openai_format.batch_record import BatchRecord
from kvbatch.jobs.openai_format.schemas import EMBEDDINGS_URL, SCORING_URLS
from kvbatch.jobs.storage import StorageError, open_storage

log = logging.getLogger("kvbatch.run")

__all__ = [  # what callers import from here (the rest is in its own file beside this one)
    "JobError", "JobInterrupted", "JobPaths", "PreparedJob", "RunMonitor", "RunOptions",
    "job_identity", "line_digest", "prepare_requests", "resolve_paths", "run_job",
]  # fmt: skip


def run_job(opts: RunOptions, llm=None) -> BatchRecord:
    """Run a whole job; returns the final batch record (also written as batch.json).

    The output is locked for the run (a second run on it raises JobError naming the holder).
    On every way out, KeyboardInterrupt included, the answers finished so far are committed to
    the partial output, so `--resume` continues from them; Ctrl-C raises JobInterrupted saying
    whether there are any.

    The model is loaded when the first line needs its tokenizer: a job where no line can run
    (an empty file, every line refused at validation or answered by an earlier run) ends
    without loading it."""
    paths = resolve_paths(opts)
    try:
        source = open_storage(opts.input)
        targets = [
            open_storage(u)
            for u in (paths.output, paths.errors, paths.batch)
            if not u.startswith("-")
        ]
        refuse_overwriting_the_input(
            local_path(opts.input), [paths.output, paths.errors, paths.batch]
        )
        refuse_one_file_twice(paths)
        if opts.work_dir and paths.partial.parent.exists() and not paths.partial.parent.is_dir():
            raise StorageError(
                f"--work-dir {opts.work_dir} is a file, not a folder: name a folder (one that "
                "does not exist yet is created)"
            )
        source.check_readable()
        for t in targets:
            t.check_writable()
    except StorageError as e:
        raise JobError(str(e)) from e
    try:
        with output_lock(paths.output, opts.input), ExitStack() as held:
            if paths.output == "-":  # no output file to lock: the partial output is locked
                claim = claim_partial(paths.partial, opts.input, resume=opts.resume)
                partial = held.enter_context(claim)
                paths = dataclasses.replace(
                    paths, partial=partial, resumable=partial == paths.partial
                )
            return _run_locked(opts, paths, source, llm)
    except KeyboardInterrupt:
        raise JobInterrupted(interrupted_message(paths)) from None
    except OutputBusy as e:
        raise JobError(str(e)) from e
    except StorageError as e:
        raise JobError(f"{e}; {kept_message(paths)}") from e
    except OSError as e:
        where = e.filename or f"the partial output {paths.partial}"
        raise JobError(f"cannot write {where}: {e.strerror}; {kept_message(paths)}") from e


def _run_locked(opts: RunOptions, paths: JobPaths, source, llm) -> BatchRecord:
    record = BatchRecord.start(
        batch_id=_batch_id(opts.input, paths.output),
        input_uri=opts.input,
        output_uri=paths.output,
        errors_uri=paths.errors,
        model=opts.model,
    )
    model = ModelOnDemand(opts, llm)
    partial = PartialOutput(paths.partial)
    try:
        return _run_into(partial, opts, paths, source, model, record)
    except (ModelNotLoaded, KeyboardInterrupt):
        partial.close()  # commits what finished
        if not holds_answers(paths.partial):  # nothing to resume: nothing left behind
            partial.remove()
        raise


def _run_into(
    partial: PartialOutput, opts: RunOptions, paths: JobPaths, source, model, record
) -> BatchRecord:
    identity = json.loads(json.dumps(job_identity(opts), default=str))
    try:
        done = partial.recover(identity) if opts.resume else partial.reset(identity)
    except PartialError as e:
        raise JobError(str(e)) from e
    if done:
        log.info("resuming: %d requests already answered", len(done))
    elif opts.resume:  # say so: a user who expected a resume should not wait for a full run
        log.info(
            "--resume: no answers of an earlier run in %s: answering every line", paths.partial
        )

    # The spilled prompts, requests and errors go in a folder of the job's own, beside the
    # partial output: a killed run's spill is then found and removed by the next run instead
    # of lingering (mkstemp names differ per run) in the output's folder.
    spill = paths.partial.with_name(paths.partial.name + ".tokens")
    _fresh_private_folder(spill)
    try:
        with TokenStore(spill) as store:
            job = prepare_lines(source, opts, model, store, done, _scan_progress(opts))
            del done  # the digests of an earlier run's answers: job.answered has what counts
            try:
                _run_prepared(opts, model, store, job, partial, record)
                record.mark_finalizing()
                try:
                    finalize(paths, partial, job, record)
                except OSError as e:
                    where = e.filename or f"the output {paths.output}"
                    raise JobError(
                        f"cannot write {where}: {e.strerror}; {kept_message(paths)}"
                    ) from e
            finally:
                job.close()
    finally:
        partial.close()
        shutil.rmtree(spill, ignore_errors=True)
    partial.remove()
    return record


def _scan_progress(opts: RunOptions) -> ScanProgress:
    """Lines tokenized and (for a local input, whose size is known) an ETA, on stderr every
    10 s while the pass runs; a pass shorter than that says nothing."""
    path = local_path(opts.input)
    try:
        total = None if path == "-" or "://" in path else Path(path).stat().st_size
    except OSError:  # read by then, or the pass will say why: only the ETA is lost
        total = None
    return ScanProgress(total, command="kvbatch run")


def _run_prepared(opts: RunOptions, model, store: TokenStore, job: PreparedJob, partial, record):
    model.longest_request = job.longest_request  # job_first: the engine's context
    if model.loaded:  # lines were judged by the engine's context, maybe capped
        advice = long_line_advice(model.engine)
        if advice:  # lines longer than a context capped at the KV cache: which flags help
            job.errors.advise("context_length_exceeded", advice)
    record.mark_in_progress()
    try:
        if len(store):
            _answer(opts, model.engine, store, job, partial, record)
        else:
            log.info(
                "no line to run (%d answered by an earlier run, %d refused): the model is "
                "not needed",
                len(job.answered),
                len(job.errors),
            )
            warn_missing_model(opts.model)
    finally:
        partial.close()
    if model.loaded:
        _log_speculation(model.engine)


def _fresh_private_folder(folder: Path) -> None:
    """An empty folder of our own at `folder`: a link planted there is removed, not followed."""
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700, parents=True)


def _answer(opts: RunOptions, engine, store: TokenStore, job: PreparedJob, partial, record):
    order = group_by_prefix((store[i] for i in range(len(store))), engine.config.cache.block_size)
    pooled = job.endpoint in (EMBEDDINGS_URL, *SCORING_URLS)  # nothing generated
    if pooled:
        log.info("%d inputs to embed or score, %d invalid lines", len(store), len(job.errors))
    else:
        log.info(
            "%d requests to run, %d invalid lines; prefix grouping: %d of %d prompt tokens "
            "shareable",
            len(store),
            len(job.errors),
            order.ideal_cached_tokens,
            order.prompt_tokens,
        )
    # An embeddings line fills one store entry per input: its key is its first entry's.
    requests = job.requests
    feed = (
        EngineRequest(
            key=i - requests.input_index(i),
            input=requests.input_index(i),
            token_ids=store[i],
            params=engine_params(requests[i]),
        )
        for i in order.order
    )
    work = requests.work(order.prompt_tokens, order.ideal_cached_tokens)
    progress = Progress(engine, work, embeddings=pooled)
    context = LineContext(job.model_name, record.id, record.created_at)
    monitor = opts.monitor
    watch = None if monitor is None else lambda: monitor.step(engine) or False
    try:
        answers = answer(
            engine, feed, requests.__getitem__, context, window=opts.window, should_stop=watch
        )
        for done in answers:
            if monitor is not None:
                monitor.output(done.output)
            if done.line is not None:
                partial.add(done.line, requests.digest(done.key), requests[done.key].line)
            progress.update(done.output, done.key + done.input)
    finally:
        progress.close()


def _log_speculation(engine) -> None:
    if getattr(engine, "spec", None) is None:
        return
    stats = engine.stats()
    if stats.spec_draft_tokens:
        log.info(
            "speculative decoding: %d of %d draft tokens accepted (%.0f%%; by position %s)",
            stats.spec_accepted_tokens,
            stats.spec_draft_tokens,
            100 * stats.spec_acceptance_rate,
            ", ".join(f"{a:.0%}" for a in stats.spec_acceptance_by_position),
        )


def _batch_id(input_uri: str, output_uri: str) -> str:
    """Stable across --resume, so response ids stay the same."""
    return "batch_" + hashlib.sha256(f"{input_uri}\0{output_uri}".encode()).hexdigest()[:24]


def _now() -> int:
    return int(time.time())

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
import os
import shutil
import stat
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvbatch.hub import ModelNotFoundError, resolve_model, split_hub_id
from kvbatch.jobs.answering import EngineRequest, LineContext, answer
from kvbatch.jobs.context_flags import as_flags, long_line_advice
from kvbatch.jobs.grouping import group_by_prefix
from kvbatch.jobs.job_context import engine_settings, request_tokens
from kvbatch.jobs.local.eta import JobWork
from kvbatch.jobs.local.output_lock import OutputBusy, output_lock
from kvbatch.jobs.local.partial import PartialError, PartialOutput
from kvbatch.jobs.local.partial_claim import claim_partial
from kvbatch.jobs.local.progress import Progress
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.openai_format.batch_record import MAX_BATCH_ERRORS, BatchRecord
from kvbatch.jobs.openai_format.endpoint import EndpointRule
from kvbatch.jobs.openai_format.prompts import (
    PromptError,
    embedding_token_ids,
    prompt_token_ids,
    sampling_params_for,
)
from kvbatch.jobs.openai_format.responses import error_line
from kvbatch.jobs.openai_format.schemas import EMBEDDINGS_URL
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, read_lines, validate_lines
from kvbatch.jobs.storage import StorageError, open_storage

log = logging.getLogger("kvbatch.run")


class JobError(Exception):
    """The job could not run at all (nothing was answered)."""


class JobInterrupted(JobError):
    """Ctrl-C: the message says whether answers were kept for `--resume`."""


class RunMonitor(Protocol):
    """What watches a run from outside (`kvbatch run --metrics-port`): the engine between
    its steps, and every output it finishes. Must not raise."""

    def step(self, engine) -> None: ...

    def output(self, out) -> None: ...


@dataclass
class RunOptions:
    input: str
    model: str
    output: str | None = None  # default: <input stem>.output.jsonl beside a local input
    errors: str | None = None  # default: <output stem>.errors.jsonl beside the output
    model_name: str | None = None  # the job's model name; default: the first line's "model"
    resume: bool = False
    window: int = 0  # requests inside the engine at once; 0 = 4 x max_num_seqs
    work_dir: str | None = None  # where the resumable partial output lives
    engine: dict = field(default_factory=dict)  # engine.LLM keyword arguments
    # reads tool calls out of chat answers with tool_choice "auto" (kvbatch.jobs.openai_format.tool_parsers)
    tool_call_parser: str | None = None
    monitor: RunMonitor | None = None  # metrics; changes no answer


@dataclass
class JobPaths:
    output: str
    errors: str
    batch: str
    partial: Path
    # False for a run to stdout that found the usual partial output held by another run and
    # keeps its answers in one of its own (kvbatch.jobs.local.partial_claim), which --resume
    # does not look for
    resumable: bool = True


def resolve_paths(opts: RunOptions) -> JobPaths:
    if opts.output is None:
        if opts.input == "-" or opts.input.startswith("s3://"):
            raise JobError("give -o OUTPUT when the input is stdin or S3")
        opts_output = str(_beside(_local(opts.input), ".output.jsonl"))
    else:
        opts_output = _file_name(opts.output, "-o")
    if opts_output == "-":
        errors = _file_name(opts.errors, "--errors") if opts.errors else "-stderr"
        batch = "-stderr"
    else:
        errors = (
            _file_name(opts.errors, "--errors")
            if opts.errors
            else _sibling(opts_output, ".errors.jsonl")
        )
        batch = _sibling(opts_output, ".batch.json")
    digest = hashlib.sha256(f"{opts.input}\0{opts_output}".encode()).hexdigest()[:16]
    if opts.work_dir:
        partial = Path(opts.work_dir) / f"{digest}.partial.jsonl"
    elif opts_output.startswith("s3://") or opts_output == "-":
        cache = Path(os.environ.get("KVBATCH_CACHE", Path.home() / ".cache" / "kvbatch"))
        partial = cache / "runs" / f"{digest}.partial.jsonl"
    else:
        out = Path(opts_output)
        partial = out.parent / f".{out.name}.partial"
    return JobPaths(opts_output, errors, batch, partial)


def _local(uri: str) -> str:
    """A local path as the file system spells it (file:// dropped, ~ expanded): the lock and
    the partial output sit beside it, so they must be computed from the real path."""
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return uri if uri == "-" or "://" in uri else os.path.expanduser(uri)


def _file_name(uri: str, flag: str) -> str:
    """`uri`, local paths made real, after checking that it can name a file at all: one that
    ends in '/' (or '.', '..') names a folder, and the run would only fail after the model
    loaded, or write beside it under a dotted name."""
    path = _local(uri)
    last = path.rstrip("/").rpartition("/")[2]
    if path != "-" and (path.endswith("/") or last in ("", ".", "..")):
        raise JobError(
            f"{flag} {uri} names a folder, not a file: name a file in it "
            f"({path.rstrip('/') or '.'}/answers.jsonl, say)"
        )
    return path


def _beside(path: str, suffix: str) -> Path:
    p = Path(path)
    stem = p.name[: -len(".jsonl")] if p.name.endswith(".jsonl") else p.name
    return p.with_name(stem + suffix)


def _sibling(uri: str, suffix: str) -> str:
    head, _, name = uri.rpartition("/")
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return f"{head}/{stem}{suffix}" if head else f"{stem}{suffix}"


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
        _refuse_overwriting_the_input(_local(opts.input), [paths.output, paths.errors, paths.batch])
        _refuse_one_file_twice(paths)
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
        raise JobInterrupted(_interrupted(paths)) from None
    except OutputBusy as e:
        raise JobError(str(e)) from e
    except StorageError as e:
        raise JobError(f"{e}; {_kept(paths)}") from e
    except OSError as e:
        where = e.filename or f"the partial output {paths.partial}"
        raise JobError(f"cannot write {where}: {e.strerror}; {_kept(paths)}") from e


def _kept(paths: JobPaths) -> str:
    if not paths.resumable:
        return (
            f"the answers finished so far are kept in {paths.partial}, this run's own partial "
            "output (another run to stdout held the usual one): --resume does not read it"
        )
    return (
        f"the answers finished so far are kept in {paths.partial}: fix that, then run the "
        "same command with --resume"
    )


def _interrupted(paths: JobPaths) -> str:
    if _holds_answers(paths.partial):
        if not paths.resumable:
            return f"interrupted; {_kept(paths)}"
        return (
            f"interrupted; the answers finished so far are kept in {paths.partial}: run the "
            "same command with --resume to continue"
        )
    return "interrupted before any answer was finished: nothing to resume; run it again"


def _holds_answers(partial: Path) -> bool:
    """Whether a partial output holds an answer after its header line (a link or a special
    file planted at its name is never followed: it holds none)."""
    try:
        fd = os.open(partial, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        f.readline()
        return bool(f.read(1))


def _refuse_overwriting_the_input(input_uri: str, outputs: list[str]) -> None:
    if input_uri == "-":  # stdin is read and stdout written: never one stream
        return
    if input_uri.startswith("s3://"):
        same = [o for o in outputs if o == input_uri]
    else:
        src = Path(input_uri).expanduser()
        same = [
            o
            for o in outputs
            if not o.startswith(("-", "s3://")) and _same_file(src, Path(o).expanduser())
        ]
    if same:
        raise StorageError(
            f"{same[0]} is the input file: the run would replace it; choose another -o/--errors"
        )


def _refuse_one_file_twice(paths: JobPaths) -> None:
    """The answers, the error records and batch.json are written one after the other: were two
    of them one file (`--errors` naming the output), the later would silently replace the
    earlier, and a job would report answers that are gone."""
    named = [("the answers (-o)", paths.output), ("the error records (--errors)", paths.errors)]
    named.append(("batch.json", paths.batch))
    files = [(what, uri) for what, uri in named if not uri.startswith("-")]
    for i, (first, a) in enumerate(files):
        for second, b in files[i + 1 :]:
            same = a == b if "://" in a or "://" in b else _same_file(Path(a), Path(b))
            if same:
                raise StorageError(
                    f"{b} would hold both {first} and {second}, and the second would replace "
                    "the first: give -o and --errors different files (batch.json goes beside "
                    "the output, named like it with .batch.json)"
                )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def job_identity(opts: RunOptions) -> dict:
    """What a run's answers depend on besides the input lines (those are digested one by one):
    the model and the settings that change its outputs. `--resume` refuses a partial output
    whose identity differs."""
    engine = {k: opts.engine[k] for k in _OUTPUT_SETTINGS if opts.engine.get(k) is not None}
    identity = {"model": opts.model, "model_name": opts.model_name, **engine}
    if opts.tool_call_parser is not None:  # absent when unset: older partials stay resumable
        identity["tool_call_parser"] = opts.tool_call_parser
    return identity


# Engine settings that change the answers (the rest change only speed).
_OUTPUT_SETTINGS = (
    "revision",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "max_model_len",
    "speculative",
)


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
    except (_ModelNotLoaded, KeyboardInterrupt):
        partial.close()  # commits what finished
        if not _holds_answers(paths.partial):  # nothing to resume: nothing left behind
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

    # The spilled prompts go in a folder of the job's own, beside the partial output: a killed
    # run's spill is then found and removed by the next run instead of lingering (mkstemp names
    # differ per run) in the output's folder.
    spill = paths.partial.with_name(paths.partial.name + ".tokens")
    _fresh_private_folder(spill)
    try:
        with TokenStore(spill) as store:
            job = _prepare(source, opts, model, store, done)
            model.longest_request = job.longest_request  # job_first: the engine's context
            if model.loaded:  # lines were judged by the engine's context, maybe capped
                _advise_long_lines(job, model.engine)
            record.mark_in_progress()
            if len(store):
                _answer(opts, model.engine, store, job, partial, record)
            else:
                log.info(
                    "no line to run (%d answered by an earlier run, %d refused): the model is "
                    "not needed",
                    len(done),
                    len(job.errors),
                )
                _warn_missing_model(opts.model)
    finally:
        partial.close()
        shutil.rmtree(spill, ignore_errors=True)
    if model.loaded:
        _log_speculation(model.engine)
    record.mark_finalizing()
    try:
        _finalize(paths, partial, job, record)
    except OSError as e:
        where = e.filename or f"the output {paths.output}"
        raise JobError(f"cannot write {where}: {e.strerror}; {_kept(paths)}") from e
    partial.remove()
    return record


def _advise_long_lines(job: PreparedJob, engine) -> None:
    """Lines longer than a context the engine capped at its KV cache (no --max-model-len) say
    which flags would admit them."""
    advice = long_line_advice(engine)
    if advice:
        job.errors[:] = [
            dataclasses.replace(e, message=e.message + advice)
            if e.code == "context_length_exceeded"
            else e
            for e in job.errors
        ]


def _fresh_private_folder(folder: Path) -> None:
    """An empty folder of our own at `folder`: a link planted there is removed, not followed."""
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(mode=0o700, parents=True)


def _warn_missing_model(model: str) -> None:
    """A mistyped --model would otherwise go unsaid when no line needed the model."""
    if Path(str(model)).expanduser().exists():
        return
    try:
        split_hub_id(str(model))
    except ModelNotFoundError as e:
        log.warning("%s; no line needed it this time", e)


class _ModelNotLoaded(JobError):
    """The model failed to load."""


class ModelOnDemand:
    """The job's model: what the validation pass asks of it (`tokenizer`, `max_model_len`),
    then the engine that runs the lines.

    With --max-model-len unset (and no `llm` given) the job picks the context (`job_first`,
    kvbatch.jobs.job_context): lines are judged against the model's own context, read with the
    tokenizer but without the weights, and the engine loads afterwards at the job's
    `longest_request` (set by the caller). Otherwise the engine loads the first time a line
    needs its tokenizer, and lines are judged against its context."""

    def __init__(self, opts: RunOptions, llm=None) -> None:
        self._opts, self._llm = opts, llm
        self.job_first = llm is None and not opts.engine.get("max_model_len")
        self.longest_request = 0
        self._files: _Given | None = None  # job_first: the tokenizer and the model's context

    @property
    def loaded(self) -> bool:
        return self._llm is not None

    @property
    def engine(self):
        if self._llm is None:
            from kvbatch.engine import LLM  # torch is imported here, once a line can run

            try:
                longest = self.longest_request if self.job_first else 0
                settings = engine_settings(self._opts.engine, longest)
                self._llm = LLM(model=self._opts.model, **settings)
            except (OSError, ValueError) as e:
                raise _ModelNotLoaded(f"cannot load the model: {as_flags(str(e))}") from e
        return self._llm.engine

    @property
    def tokenizer(self):
        files = self._model_files()
        tokenizer = self.engine.tokenizer if files is None else files.tokenizer
        if tokenizer is None:
            raise JobError(f"the model {self._opts.model} has no tokenizer: jobs need one")
        return tokenizer

    @property
    def max_model_len(self) -> int:
        files = self._model_files()
        return self.engine.max_model_len if files is None else files.max_model_len

    def _model_files(self) -> _Given | None:
        """job_first: the tokenizer and the model's own context, read once without the
        weights (a Hub id's configs and tokenizer are fetched, as `kvbatch submit` does). A
        model they cannot be read of loads its engine first instead, whose error (or success:
        a config only the engine understands) is the word on it."""
        if self.job_first and self._files is None:
            from kvbatch.jobs import model_info  # imports torch: once a line can run

            try:
                path = resolve_model(
                    self._opts.model, self._opts.engine.get("revision"), tokenizer_only=True
                )
                tokenizer = model_info.load_tokenizer(path)
                self._files = _Given(tokenizer, model_info.max_model_len(path, None, tokenizer))
            except Exception as e:  # whatever transformers raised: the engine tries next
                log.debug("reading %s without its weights failed (%s)", self._opts.model, e)
                self.job_first = False
        return self._files if self.job_first else None


class _Given:
    """A tokenizer and context length known beforehand (`kvbatch submit` reads them without
    loading the weights)."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len


def _answer(opts: RunOptions, engine, store: TokenStore, job: PreparedJob, partial, record):
    order = group_by_prefix((store[i] for i in range(len(store))), engine.config.cache.block_size)
    if job.endpoint == EMBEDDINGS_URL:
        log.info("%d inputs to embed, %d invalid lines", len(store), len(job.errors))
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
    feed = (
        EngineRequest(
            key=i - job.input_index[i],
            input=job.input_index[i],
            token_ids=store[i],
            params=_engine_params(job.requests[i]),
        )
        for i in order.order
    )
    work = JobWork.of(job.requests, order.prompt_tokens, order.ideal_cached_tokens)
    progress = Progress(engine, work, embeddings=job.endpoint == EMBEDDINGS_URL)
    context = LineContext(job.model_name, record.id, record.created_at)
    monitor = opts.monitor
    watch = None if monitor is None else lambda: monitor.step(engine) or False
    try:
        answers = answer(
            engine, feed, job.requests.__getitem__, context, window=opts.window, should_stop=watch
        )
        for done in answers:
            if monitor is not None:
                monitor.output(done.output)
            if done.line is not None:
                req = job.requests[done.key]
                partial.add(done.line, job.digest_of[req.custom_id])
            progress.update(done.output, done.key + done.input)
    finally:
        progress.close()


def _engine_params(req: JobRequest):
    """What feed_in_order hands the engine: the sampling params, or None to embed."""
    return None if req.is_embedding else req.params


@dataclass
class PreparedJob:
    # indexed like the token store; messages dropped. An embeddings line with k inputs fills
    # k entries (the same request), input_index telling which input each one is.
    requests: list[JobRequest]
    line_of: dict[str, int]  # custom_id -> input line, for ordering the output
    digest_of: dict[str, str]  # custom_id -> digest of its input line (what an answer is of)
    errors: list[LineError]
    model_name: str
    urls: set[str]  # of every valid line, answered in an earlier run (--resume) or not
    input_index: list[int] = field(default_factory=list)  # like requests: 0 but for embeddings
    endpoint: str = "/v1/chat/completions"  # batch.json's: see kvbatch.jobs.openai_format.endpoint
    # prompt + output cap of the longest request to run (an embeddings input: its tokens);
    # the context the engine runs at without --max-model-len (kvbatch.jobs.job_context)
    longest_request: int = 0


def prepare_requests(
    source,
    opts: RunOptions,
    tokenizer,
    max_len: int,
    store: TokenStore,
    done: Mapping[str, str],
) -> PreparedJob:
    """Validation pass: stream the input once, tokenize, spill tokens, collect errors.

    `done` ({custom_id: line digest}, from --resume) names the lines answered already: a line
    whose digest still matches is skipped; one that changed is answered again. Shared by
    `kvbatch run` and `kvbatch submit`, so both judge lines the same way."""
    if tokenizer is None:
        raise JobError(f"the model {opts.model} has no tokenizer: jobs need one")
    return _prepare(source, opts, _Given(tokenizer, max_len), store, done)


def _prepare(source, opts: RunOptions, model, store: TokenStore, done: Mapping[str, str]):
    """prepare_requests, asking `model` (ModelOnDemand, or _Given) for the tokenizer and the
    context length only when a line needs them."""
    requests: list[JobRequest] = []
    line_of: dict[str, int] = {}
    digest_of: dict[str, str] = {}
    errors: list[LineError] = []
    job_model = opts.model_name
    model_decided = job_model is not None  # by the flag, or else by the first valid line
    endpoint = EndpointRule()
    input_index: list[int] = []
    urls: set[str] = set()
    params_seen: dict = {}  # identical SamplingParams are shared: millions of lines, few kinds
    longest = 0
    try:
        with source.open_read() as f:
            lines = _LastLine(read_lines(f))
            for item in validate_lines(
                lines, model=opts.model_name, tool_call_parser=opts.tool_call_parser
            ):
                if isinstance(item, LineError):
                    errors.append(item)
                    continue
                line_of[item.custom_id] = item.line
                mismatch = endpoint.check(item)
                if mismatch is not None:
                    errors.append(mismatch)
                    continue
                if not model_decided:
                    job_model, model_decided = item.model, True
                elif item.model is not None and job_model is not None and item.model != job_model:
                    errors.append(
                        LineError(
                            item.line,
                            item.custom_id,
                            "model_mismatch",
                            f"line {item.line}: model {item.model!r} differs from the job's model "
                            f"{job_model!r}: a batch runs one model; split the file",
                        )
                    )
                    continue
                urls.add(item.url)
                digest = line_digest(lines.last)
                digest_of[item.custom_id] = digest
                if done.get(item.custom_id) == digest:
                    continue
                if item.is_embedding:
                    try:
                        inputs = embedding_token_ids(item, model.tokenizer, model.max_model_len)
                    except PromptError as e:
                        errors.append(e.line_error(item))
                        continue
                    item = dataclasses.replace(item, inputs=None)
                    longest = max(longest, *(request_tokens(len(ids), None) for ids in inputs))
                    for i, ids in enumerate(inputs):
                        requests.append(item)
                        input_index.append(i)
                        store.append(ids)
                    continue
                try:
                    ids = prompt_token_ids(item, model.tokenizer, model.max_model_len)
                    params = sampling_params_for(item, len(ids), model.max_model_len)
                except PromptError as e:
                    errors.append(
                        LineError(item.line, item.custom_id, e.code, f"line {item.line}: {e}")
                    )
                    continue
                try:
                    params = params_seen.setdefault(params, params)
                except TypeError:  # a logit_bias dict makes the params unhashable: not shared
                    pass
                requests.append(
                    dataclasses.replace(item, messages=None, prompt=None, tools=None, params=params)
                )
                input_index.append(0)
                store.append(ids)
                longest = max(longest, request_tokens(len(ids), params))
    except StorageError as e:
        raise JobError(str(e)) from e
    name = job_model or Path(opts.model.rstrip("/")).name
    return PreparedJob(
        requests, line_of, digest_of, errors, name, urls, input_index, endpoint.endpoint, longest
    )


def line_digest(raw: bytes) -> str:
    """What an answer is an answer to: the input line's bytes, outer whitespace aside."""
    return hashlib.sha256(raw.strip()).hexdigest()[:32]


class _LastLine:
    """Iterates a file's lines and remembers the last one: validate_lines is lazy (one record
    per line, yielded before the next line is read), so it is the line of the record in hand."""

    def __init__(self, lines) -> None:
        self._lines = lines
        self.last = b""

    def __iter__(self):
        for raw in self._lines:
            self.last = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
            yield raw


def _finalize(
    paths: JobPaths, partial: PartialOutput, job: PreparedJob, record: BatchRecord
) -> None:
    """Write answers in input order and errors by line number; count and sum usage."""
    answered: list[tuple[int, int, int]] = []  # (input line, offset, length) in the partial
    failed: list[tuple[int, int, int]] = []
    seen: set[str] = set()
    for line, digest, offset, length in partial.records():
        custom_id = line["custom_id"]
        # Only answers to the input as it is now: a line edited or removed since an
        # interrupted run (or another job's answers) is not reused.
        if job.digest_of.get(custom_id) != digest or custom_id in seen:
            continue
        seen.add(custom_id)
        n = job.line_of[custom_id]
        if line.get("error"):
            failed.append((n, offset, length))
        else:
            answered.append((n, offset, length))
            body = line["response"]["body"]
            record.add_usage(body["usage"])
            record.vectors += len(body.get("data") or ())  # an embeddings answer's
    answered.sort()
    _write(paths.output, partial.read_at((o, ln) for _, o, ln in answered))
    # Error records: the engine's (in the partial) and validation's (in memory), by line.
    validation = [
        (
            err.line,
            json.dumps(error_line(err, batch_id=record.id), ensure_ascii=False).encode() + b"\n",
        )
        for err in job.errors
    ]
    engine_errors = list(
        zip((n for n, _, _ in failed), partial.read_at((o, ln) for _, o, ln in failed))
    )
    errors = sorted(validation + engine_errors, key=lambda x: x[0])
    _write(paths.errors, (raw for _, raw in errors))
    record.endpoint = job.endpoint
    record.finish(
        completed=len(answered),
        failed=len(errors),
        ran=len(answered) + len(engine_errors),
        samples=(json.loads(raw)["error"] for _, raw in errors[:MAX_BATCH_ERRORS]),
    )
    _write(paths.batch, [json.dumps(record.to_dict(), indent=2).encode() + b"\n"])


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


def _write(uri: str, chunks) -> None:
    if uri == "-stderr":
        import sys

        for c in chunks:
            sys.stderr.write(c.decode())
        return
    with open_storage(uri).open_write() as f:
        for c in chunks:
            f.write(c)


def _batch_id(input_uri: str, output_uri: str) -> str:
    """Stable across --resume, so response ids stay the same."""
    return "batch_" + hashlib.sha256(f"{input_uri}\0{output_uri}".encode()).hexdigest()[:24]


def _now() -> int:
    return int(time.time())

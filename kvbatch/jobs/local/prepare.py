"""The validation pass of a job: stream the input once, validate each line, tokenize it (the
chat template applied), spill the token ids to disk and collect the error records. Shared by
`kvbatch run` and `kvbatch submit`, so both judge lines alike."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvbatch.env_settings import SettingError
from kvbatch.jobs.job_context import request_tokens
from kvbatch.jobs.local.digest_index import DigestIndex, hex_key, id_number, key_of
from kvbatch.jobs.local.line_chunks import ChunkJudge, LineRules, line_digest, tokenized
from kvbatch.jobs.local.line_errors import LineErrors
from kvbatch.jobs.local.line_pool import JudgedLines, default_workers
from kvbatch.jobs.local.model_on_demand import GivenModel
from kvbatch.jobs.local.options import JobError, RunOptions
from kvbatch.jobs.local.request_store import RequestStore
from kvbatch.jobs.local.scan_progress import ScanProgress
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.openai_format.endpoint import EndpointRule
from kvbatch.jobs.openai_format.prompts import PromptError
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, check_line
from kvbatch.jobs.storage import StorageError


def engine_params(req: JobRequest):
    """What feed_in_order hands the engine: the sampling params, or None to embed."""
    return None if req.is_pooled else req.params


@dataclass
class PreparedJob:
    """What the validation pass leaves of a job, on disk but for a few integers a line."""

    requests: RequestStore  # indexed like the token store (messages dropped)
    errors: LineErrors  # the validation errors, in line order
    # the lines an earlier run answered (--resume), as they are now: {digest: input line}
    answered: DigestIndex
    model_name: str
    urls: set[str]  # of every valid line, answered in an earlier run (--resume) or not
    endpoint: str = "/v1/chat/completions"  # batch.json's: see kvbatch.jobs.openai_format.endpoint
    # prompt + output cap of the longest request to run (an embeddings input: its tokens);
    # the context the engine runs at without --max-model-len (kvbatch.jobs.job_context)
    longest_request: int = 0

    def close(self) -> None:
        self.requests.close()
        self.errors.close()


def prepare_requests(
    source,
    opts: RunOptions,
    tokenizer,
    max_len: int,
    store: TokenStore,
    done: DigestIndex,
) -> PreparedJob:
    """Validation pass: stream the input once, tokenize, spill tokens, collect errors.

    `done` ({16-byte digest of a line an earlier run answered: the id_number of its answer's
    custom_id}, PartialOutput.recover; empty for none) names the lines answered already: a line
    whose digest and custom_id still match is skipped; one that changed is answered again. Shared by `kvbatch run` and `kvbatch submit`, so both judge
    lines the same way."""
    if tokenizer is None:
        raise JobError(f"the model {opts.model} has no tokenizer: jobs need one")
    return prepare_lines(source, opts, GivenModel(tokenizer, max_len), store, done)


def prepare_lines(
    source,
    opts: RunOptions,
    model,
    store: TokenStore,
    done: DigestIndex,
    progress: ScanProgress | None = None,
) -> PreparedJob:
    """prepare_requests, asking `model` (ModelOnDemand, or GivenModel) for the tokenizer and the
    context length only when a line needs them. The requests and errors are spilled beside
    the token store, in its folder; close the job to remove them. `progress` shows the pass."""
    requests = RequestStore(store.folder)
    errors = LineErrors(store.folder)
    answered = DigestIndex()
    traits = JobTraits(opts)
    lines = read = 0  # lines judged, and input bytes up to the last valid one
    try:
        for item in scan_lines(source, opts, model, done, traits):
            lines += 1
            if isinstance(item, LineError):
                errors.append(item)
            elif isinstance(item, AnsweredLine):
                answered.add(hex_key(item.digest), item.line)
            else:
                requests.add_line(item.request, item.digest, len(item.inputs))
                for ids in item.inputs:
                    store.append(ids)
                read = item.offset + item.size
            if progress is not None and lines % 256 == 0:
                progress.update(lines, read)
        if progress is not None:
            progress.lines = lines
            progress.done(read)
    except BaseException:
        requests.close()
        errors.close()
        raise
    return PreparedJob(
        requests, errors, answered, traits.job_name(), traits.urls, traits.endpoint.endpoint,
        traits.longest,
    )  # fmt: skip


@dataclass(frozen=True)
class PreparedLine:
    """A valid line to run: its request (text dropped), its token ids and where it lies in the
    input (so a second pass can read it again instead of keeping it)."""

    request: JobRequest
    inputs: list[list[int]]  # the prompt's token ids, or one list per embeddings input
    offset: int  # byte offset of the line in the input
    size: int  # its length in bytes
    digest: str  # line_digest of the line

    @property
    def custom_id(self) -> str:
        return self.request.custom_id

    @property
    def line(self) -> int:
        return self.request.line


@dataclass(frozen=True)
class AnsweredLine:
    """A valid line that `done` (--resume) says is answered already, with these same bytes."""

    custom_id: str
    line: int
    digest: str


class JobTraits:
    """What the validation pass learns of the whole job, in a few values whatever its size:
    the job's model, the urls and endpoint of its lines, and its longest request."""

    def __init__(self, opts: RunOptions) -> None:
        self.opts = opts
        self.model = opts.model_name
        self.model_decided = self.model is not None  # by the flag, or by the first valid line
        self.endpoint = EndpointRule()
        self.urls: set[str] = set()
        self.longest = 0  # prompt + output cap of the longest request (kvbatch.jobs.job_context)

    def job_name(self) -> str:
        return self.model or Path(self.opts.model.rstrip("/")).name

    def model_error(self, item: JobRequest) -> LineError | None:
        """A line naming another model than the job's (the first valid line decides it)."""
        if not self.model_decided:
            self.model, self.model_decided = item.model, True
        elif item.model is not None and self.model is not None and item.model != self.model:
            return LineError(
                item.line,
                item.custom_id,
                "model_mismatch",
                f"line {item.line}: model {item.model!r} differs from the job's model "
                f"{self.model!r}: a batch runs one model; split the file",
            )
        return None


def scan_lines(
    source,
    opts: RunOptions,
    model,
    done: DigestIndex,
    traits: JobTraits,
) -> Iterator[LineError | PreparedLine | AnsweredLine]:
    """The validation pass as a stream: one record per non-blank line, in input order, holding
    nothing of the lines already yielded (but the set of custom_ids seen): a LineError, an
    AnsweredLine (skipped: `done` has its digest) or a PreparedLine. `traits` collects what
    the job as a whole needs.

    Lines are validated and tokenized in chunks, by a pool of processes once the job proves
    long (kvbatch.jobs.local.line_pool, `opts.tokenize_workers`); what depends on earlier
    lines is settled here, in order, so the records are those of a line-by-line pass."""
    judge = ChunkJudge(LineRules.of(opts), model)
    seen = DigestIndex()  # the custom_ids of the lines so far, as 16-byte digests
    skip = None
    if done:  # an earlier run's answers: their lines need no tokens
        skip = lambda number, raw: hex_key(line_digest(raw)) in done  # noqa: E731
    try:
        workers = opts.tokenize_workers or default_workers()
    except SettingError as e:
        raise JobError(str(e)) from e
    try:
        with source.open_read() as f:
            for judged, raw, offset, size in JudgedLines(f, judge, workers, skip):
                item = judged.record
                if judged.taken is not None:
                    taken = key_of(judged.taken)
                    if taken in seen:  # judged apart: judged again, as a duplicate
                        item = check_line(judged.number, raw, {judged.taken},
                                          model=opts.model_name,
                                          tool_call_parser=opts.tool_call_parser)  # fmt: skip
                    else:
                        seen.add(taken)
                if isinstance(item, LineError):
                    yield item
                    continue
                mismatch = traits.endpoint.check(item) or traits.model_error(item)
                if mismatch is not None:
                    yield mismatch
                    continue
                traits.urls.add(item.url)
                if done and done.get(hex_key(judged.digest)) == id_number(item.custom_id):
                    yield AnsweredLine(item.custom_id, item.line, judged.digest)
                    continue
                tokens = judged.tokens
                if tokens is None:  # skipped for another line's answer: tokenized now
                    tokens = _tokenized_here(item, judge)
                if isinstance(tokens, PromptError):
                    yield tokens.line_error(item)
                    continue
                request, inputs = tokens
                traits.longest = max(
                    traits.longest,
                    *(request_tokens(len(ids), None if request.is_pooled else request.params)
                      for ids in inputs),
                )  # fmt: skip
                yield PreparedLine(request, inputs, offset, size, judged.digest)
    except StorageError as e:
        raise JobError(str(e)) from e


def _tokenized_here(item: JobRequest, judge: ChunkJudge):
    reasoning = judge.reasoning() if item.messages is not None else None
    try:
        return tokenized(item, judge.model, judge.params_seen, reasoning)
    except PromptError as e:
        return e

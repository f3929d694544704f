"""The validation pass of a job: stream the input once, validate each line, tokenize it (the
chat template applied), spill the token ids to disk and collect the error records. Shared by
`kvbatch run` and `kvbatch submit`, so both judge lines alike."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvbatch.env_settings import SettingError
from kvbatch.jobs.job_context import request_tokens
from kvbatch.jobs.local.line_chunks import ChunkJudge, LineRules, line_digest, tokenized
from kvbatch.jobs.local.line_pool import JudgedLines, default_workers
from kvbatch.jobs.local.model_on_demand import GivenModel
from kvbatch.jobs.local.options import JobError, RunOptions
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
    return prepare_lines(source, opts, GivenModel(tokenizer, max_len), store, done)


def prepare_lines(source, opts: RunOptions, model, store: TokenStore, done: Mapping[str, str]):
    """prepare_requests, asking `model` (ModelOnDemand, or GivenModel) for the tokenizer and the
    context length only when a line needs them."""
    requests: list[JobRequest] = []
    line_of: dict[str, int] = {}
    digest_of: dict[str, str] = {}
    errors: list[LineError] = []
    input_index: list[int] = []
    traits = JobTraits(opts)
    for item in scan_lines(source, opts, model, done, traits):
        if isinstance(item, LineError):
            errors.append(item)
            continue
        line_of[item.custom_id] = item.line
        digest_of[item.custom_id] = item.digest
        if isinstance(item, AnsweredLine):
            continue
        for i, ids in enumerate(item.inputs):
            requests.append(item.request)
            input_index.append(i)
            store.append(ids)
    return PreparedJob(
        requests, line_of, digest_of, errors, traits.job_name(), traits.urls, input_index,
        traits.endpoint.endpoint, traits.longest,
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
    done: Mapping[str, str],
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
    seen: set[str] = set()
    skip = None
    if done:  # an earlier run's answers: their lines need no tokens
        digests = set(done.values())
        skip = lambda number, raw: line_digest(raw) in digests  # noqa: E731
    try:
        workers = opts.tokenize_workers or default_workers()
    except SettingError as e:
        raise JobError(str(e)) from e
    try:
        with source.open_read() as f:
            for judged, raw, offset, size in JudgedLines(f, judge, workers, skip):
                item = judged.record
                if judged.taken is not None:
                    if judged.taken in seen:  # judged apart: judged again, as a duplicate
                        item = check_line(judged.number, raw, seen, model=opts.model_name,
                                          tool_call_parser=opts.tool_call_parser)  # fmt: skip
                    else:
                        seen.add(judged.taken)
                if isinstance(item, LineError):
                    yield item
                    continue
                mismatch = traits.endpoint.check(item) or traits.model_error(item)
                if mismatch is not None:
                    yield mismatch
                    continue
                traits.urls.add(item.url)
                if done.get(item.custom_id) == judged.digest:
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

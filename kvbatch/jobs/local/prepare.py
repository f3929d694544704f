"""The validation pass of a job: stream the input once, validate each line, tokenize it (the
chat template applied), spill the token ids to disk and collect the error records. Shared by
`kvbatch run` and `kvbatch submit`, so both judge lines alike."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvbatch.engine import NO_REASONING_PARSER, detect_reasoning_parser
from kvbatch.jobs.job_context import request_tokens
from kvbatch.jobs.local.model_on_demand import GivenModel
from kvbatch.jobs.local.options import JobError, RunOptions
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.openai_format.endpoint import EndpointRule
from kvbatch.jobs.openai_format.prompts import (
    PromptError,
    embedding_token_ids,
    prompt_token_ids,
    sampling_params_for,
)
from kvbatch.jobs.openai_format.score_prompts import pair_token_ids
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, read_lines, validate_lines
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
        self.reasoning: str | None = None  # the job's reasoning parser, from its first chat line
        self.reasoning_read = False

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
    source, opts: RunOptions, model, done: Mapping[str, str], traits: JobTraits
) -> Iterator[LineError | PreparedLine | AnsweredLine]:
    """The validation pass as a stream: one record per non-blank line, in input order, holding
    nothing of the lines already yielded (but validate_lines' set of custom_ids): a LineError,
    an AnsweredLine (skipped: `done` has its digest) or a PreparedLine. `traits` collects what
    the job as a whole needs."""
    params_seen: dict = {}  # identical SamplingParams are shared: millions of lines, few kinds
    try:
        with source.open_read() as f:
            lines = _LastLine(read_lines(f))
            for item in validate_lines(
                lines, model=opts.model_name, tool_call_parser=opts.tool_call_parser
            ):
                if isinstance(item, LineError):
                    yield item
                    continue
                mismatch = traits.endpoint.check(item) or traits.model_error(item)
                if mismatch is not None:
                    yield mismatch
                    continue
                traits.urls.add(item.url)
                digest = line_digest(lines.last)
                if done.get(item.custom_id) == digest:
                    yield AnsweredLine(item.custom_id, item.line, digest)
                    continue
                if item.messages is not None and not traits.reasoning_read:
                    traits.reasoning = job_reasoning_parser(opts, model.tokenizer)
                    traits.reasoning_read = True
                try:
                    request, inputs = tokenized(item, model, params_seen, traits.reasoning)
                except PromptError as e:
                    yield e.line_error(item)
                    continue
                traits.longest = max(
                    traits.longest,
                    *(request_tokens(len(ids), None if request.is_pooled else request.params)
                      for ids in inputs),
                )  # fmt: skip
                yield PreparedLine(request, inputs, lines.offset, lines.size, digest)
    except StorageError as e:
        raise JobError(str(e)) from e


def tokenized(
    item: JobRequest, model, params_seen: dict | None = None, reasoning: str | None = None
):
    """(the request with its text dropped, its token ids: one list, or one per embeddings
    input). Raises PromptError (with the line's own message) when a prompt cannot run.
    `params_seen` shares equal SamplingParams between lines; `reasoning` names the job's
    reasoning parser (gpt-oss prompts are rendered by harmony)."""
    if item.is_embedding:
        inputs = embedding_token_ids(item, model.tokenizer, model.max_model_len)
        return dataclasses.replace(item, inputs=None), inputs
    if item.is_score:
        model_name = item.model or "the model"
        inputs = pair_token_ids(item, model.tokenizer, model.max_model_len, model_name)
        return dataclasses.replace(item, pairs=None), inputs
    ids = prompt_token_ids(item, model.tokenizer, model.max_model_len, reasoning)
    params = sampling_params_for(item, len(ids), model.max_model_len)
    if params_seen is not None:
        try:
            params = params_seen.setdefault(params, params)
        except TypeError:  # a logit_bias dict makes the params unhashable: not shared
            pass
    request = dataclasses.replace(item, messages=None, prompt=None, tools=None, params=params)
    return request, [ids]


def job_reasoning_parser(opts: RunOptions, tokenizer) -> str | None:
    """The name of the reasoning parser the job's engine will use: --reasoning-parser, else
    the one the model's tokenizer calls for (the engine chooses the same way); None: none."""
    named = opts.engine.get("reasoning_parser")
    if named == NO_REASONING_PARSER:
        return None
    return named or detect_reasoning_parser(tokenizer)


def line_digest(raw: bytes) -> str:
    """What an answer is an answer to: the input line's bytes, outer whitespace aside."""
    return hashlib.sha256(raw.strip()).hexdigest()[:32]


class _LastLine:
    """Iterates a file's lines and remembers the last one, its byte offset and its size:
    validate_lines is lazy (one record per line, yielded before the next line is read), so it
    is the line of the record in hand."""

    def __init__(self, lines) -> None:
        self._lines = lines
        self.last = b""
        self.offset = 0
        self.size = 0

    def __iter__(self):
        for raw in self._lines:
            self.last = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
            self.offset += self.size
            self.size = getattr(raw, "size", len(self.last))  # an OversizedLine's whole length
            yield raw

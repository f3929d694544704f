"""The validation pass of a job: stream the input once, validate each line, tokenize it (the
chat template applied), spill the token ids to disk and collect the error records. Shared by
`kvbatch run` and `kvbatch submit`, so both judge lines alike."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
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
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, read_lines, validate_lines
from kvbatch.jobs.storage import StorageError


def engine_params(req: JobRequest):
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
    return prepare_lines(source, opts, GivenModel(tokenizer, max_len), store, done)


def prepare_lines(source, opts: RunOptions, model, store: TokenStore, done: Mapping[str, str]):
    """prepare_requests, asking `model` (ModelOnDemand, or GivenModel) for the tokenizer and the
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
    reasoning, reasoning_read = None, False  # the job's reasoning parser, from its first chat line
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
                if item.messages is not None and not reasoning_read:
                    reasoning, reasoning_read = job_reasoning_parser(opts, model.tokenizer), True
                try:
                    ids = prompt_token_ids(item, model.tokenizer, model.max_model_len, reasoning)
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
    """Iterates a file's lines and remembers the last one: validate_lines is lazy (one record
    per line, yielded before the next line is read), so it is the line of the record in hand."""

    def __init__(self, lines) -> None:
        self._lines = lines
        self.last = b""

    def __iter__(self):
        for raw in self._lines:
            self.last = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
            yield raw

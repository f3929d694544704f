"""Streaming validation of an OpenAI Batch input file: every line becomes one record.

`validate_lines` reads one line at a time (a 10 GB job is never held whole) and yields, per
non-blank line, either a `JobRequest` (ready for the engine) or a `LineError` (one record,
with its 1-based line number and a message that says what to fix). A bad line never stops
the job. When a line has several problems the message lists them all ("; "-separated) and
`code` is that of the first, in the order of this table:

==========================  ===============================================================
code                        the line ...
==========================  ===============================================================
invalid_encoding            is not UTF-8, or holds a lone surrogate escape ("\ud800")
line_too_long               is longer than MAX_LINE_BYTES (16 MiB)
invalid_json                is not JSON (NaN and Infinity are not JSON either), or nests
                            arrays/objects deeper than Python's JSON reader can follow
not_an_object               is JSON but not an object
missing_custom_id           has no custom_id
invalid_custom_id           has a custom_id that is not a non-empty string of <= 512 chars
duplicate_custom_id         repeats the custom_id of an earlier line (the first one keeps it)
invalid_method              has a method other than "POST"
invalid_url                 has a url other than /v1/chat/completions or /v1/completions
invalid_body                has no body, or a body that is not an object
model_mismatch              names a model other than the job's (no "model" is fine)
missing_messages            is a chat request without messages
missing_prompt              is a completions request without a prompt
unknown_parameter           has a field the endpoint does not know (a typo, usually)
unsupported_parameter       asks for something kvbatch does not do (stream, functions,
                            tool_choice "auto" in a job without --tool-call-parser, ...)
invalid_messages            has a malformed message (role, content, parts)
invalid_parameter           has a parameter of the wrong type or out of range
==========================  ===============================================================

Prompt length needs the tokenizer: `kvbatch.jobs.openai_format.prompts` checks it later (context_length_exceeded,
invalid_prompt) and turns its errors into `LineError`s of the same shape.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from pydantic import BaseModel, ValidationError

from kvbatch.engine import SamplingParams, as_pairs
from kvbatch.jobs.openai_format.schemas import (
    BODIES,
    CHAT_URL,
    EMBEDDINGS_URL,
    MAX_CUSTOM_ID_LEN,
    PARAMETER_RULE,
    RERANK_URL,
    SCORING_URLS,
    URLS,
    BatchLine,
    ChatCompletionBody,
    CompletionBody,
    EmbeddingBody,
    RerankBody,
    ScoreBody,
)
from kvbatch.jobs.openai_format.shown import shown
from kvbatch.jobs.openai_format.tools import ToolCalling

MAX_LINE_BYTES = 16 * 1024 * 1024
EMBEDDING_PARAMS = SamplingParams(max_tokens=1)
"""What an embeddings request holds in JobRequest.params: it is never sampled."""

# Codes in the order a line's problems are reported (the first one names the record).
CODES = (
    "invalid_encoding",
    "line_too_long",
    "invalid_json",
    "not_an_object",
    "missing_custom_id",
    "invalid_custom_id",
    "duplicate_custom_id",
    "invalid_method",
    "invalid_url",
    "invalid_body",
    "model_mismatch",
    "missing_messages",
    "missing_prompt",
    "unknown_parameter",
    "unsupported_parameter",
    "invalid_messages",
    "invalid_parameter",
)
_RANK = {code: i for i, code in enumerate(CODES)}
_LINE_FIELD_CODES = {
    "custom_id": "invalid_custom_id",
    "method": "invalid_method",
    "url": "invalid_url",
    "body": "invalid_body",
}


@dataclass(frozen=True)
class JobRequest:
    """One valid line, ready to be tokenized (`kvbatch.jobs.openai_format.prompts`) and run."""

    line: int  # 1-based line number in the input
    custom_id: str
    url: str  # "/v1/chat/completions" | "/v1/completions" | "/v1/embeddings"
    # chat: [{role, content[, name, tool_calls, tool_call_id]}], developer -> system
    messages: list[dict] | None
    prompt: str | list[int] | None  # completions: text, or token ids as given
    params: SamplingParams
    # chat: top_logprobs when logprobs=true (0 without top_logprobs); completions: the int;
    # None = no logprobs. Equal to params.logprobs.
    logprobs: int | None
    model: str | None  # as the body names it
    # The output cap the line set itself (max_tokens / max_completion_tokens), or None; then
    # params.max_tokens holds the default (a cap that is clamped to the room left, never an
    # error). See kvbatch.jobs.openai_format.prompts.max_tokens_for.
    max_tokens: int | None = None
    # embeddings: one prompt per vector of the answer (text, or token ids as given), and how
    # the answer carries them
    inputs: list[str | list[int]] | None = None
    dimensions: int | None = None
    encoding_format: str = "float"
    num_inputs: int = 1  # embeddings: how many vectors the answer holds
    # chat: the tools for the chat template ([{type: function, function: {...}}]), and how to
    # read the answer for tool calls (None: plain text; kvbatch.jobs.openai_format.tools)
    tools: list[dict] | None = None
    tool_calling: ToolCalling | None = None
    # chat: how long a reasoning model thinks (low | medium | high; None: the model's
    # default), and keywords for the chat template (vLLM's chat_template_kwargs)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None
    # score and rerank: the (query, document) pairs to score (dropped once tokenized), the
    # documents a rerank answer shows, how many of them it keeps, and the token limit a pair is
    # cut to (None: a pair too long for the model is an error)
    pairs: list[tuple[str, str]] | None = None
    documents: list[str] | None = None
    top_n: int | None = None
    truncate_prompt_tokens: int | None = None

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL

    @property
    def is_embedding(self) -> bool:
        return self.url == EMBEDDINGS_URL

    @property
    def is_score(self) -> bool:
        """A /v1/score or /v1/rerank line: each pair one pooled engine request."""
        return self.url in SCORING_URLS

    @property
    def is_rerank(self) -> bool:
        return self.url == RERANK_URL

    @property
    def is_pooled(self) -> bool:
        """Answered by prefill alone (embeddings, scores): nothing is sampled."""
        return self.is_embedding or self.is_score


@dataclass(frozen=True)
class LineError:
    """One bad line: its record in errors.jsonl (see `kvbatch.jobs.openai_format.responses.error_line`)."""

    line: int
    custom_id: str | None
    code: str  # one of CODES, or kvbatch.jobs.openai_format.prompts' context_length_exceeded / invalid_prompt
    message: str  # starts with "line N: " and says what to fix


def validate_lines(
    lines: Iterable[bytes | str],
    *,
    model: str | None = None,
    default_max_tokens: int | None = None,
    tool_call_parser: str | None = None,
) -> Iterator[JobRequest | LineError]:
    """Yield one record per non-blank line of `lines`, lazily, in input order.

    `lines` is any iterable of raw lines (a file opened in binary mode works, and is read
    one line at a time). `model`: the job's model name; a body naming another one is an
    error. `default_max_tokens`: the output cap of chat lines that set none (None = up to
    the end of the context); completions lines default to 16 like OpenAI's legacy API.
    `tool_call_parser`: the job's (kvbatch.jobs.openai_format.tool_parsers), which chat lines with
    tool_choice "auto" need.
    """
    if default_max_tokens is not None and (
        not isinstance(default_max_tokens, int) or default_max_tokens < 1
    ):
        raise ValueError(
            f"default_max_tokens must be None or an int >= 1, got {default_max_tokens!r}"
        )
    seen: set[str] = set()  # ~100 bytes per id: 10M lines cost about 1 GB
    for number, raw in enumerate(lines, start=1):
        record = _check_line(number, raw, seen, model, default_max_tokens, tool_call_parser)
        if record is not None:
            yield record


def check_line(
    number: int,
    raw: bytes | str,
    seen,
    *,
    model: str | None = None,
    tool_call_parser: str | None = None,
) -> JobRequest | LineError | None:
    """The record validate_lines yields for line `number` (None: a blank line). `seen` holds
    the custom_ids of the lines before (anything with `in` and `add`): a line with a well-formed
    custom_id adds its own, whether or not it is valid, as validate_lines does. Lets a caller
    validate lines apart (in a pool of processes) and settle duplicates itself, in line order."""
    return _check_line(number, raw, seen, model, None, tool_call_parser)


class OversizedLine(bytes):
    """The first MAX_LINE_BYTES + 1 bytes of a longer line, and its whole length in `size`."""

    size: int


def read_lines(f: BinaryIO) -> Iterator[bytes]:
    """The lines of a binary file, as iterating it gives them, except that a line longer than
    MAX_LINE_BYTES is never held whole: its head comes as an `OversizedLine` (an error record
    either way) and the rest is skipped in pieces. Iterating the file would read a 5 GB line
    without a newline into memory before validation could refuse it."""
    limit = MAX_LINE_BYTES
    while raw := f.readline(limit + 1):
        if len(raw) > limit and not raw.endswith(b"\n"):
            size = len(raw)
            while piece := f.readline(1 << 20):
                size += len(piece)
                if piece.endswith(b"\n"):
                    break
            raw = OversizedLine(raw)
            raw.size = size
        yield raw


# --- one line ---------------------------------------------------------------------------------


class _Problems:
    """A line's problems, reported together as one LineError."""

    def __init__(self, line: int) -> None:
        self.line = line
        self.custom_id: str | None = None
        self.items: list[tuple[str, str]] = []

    def add(self, code: str, message: str) -> None:
        self.items.append((code, message))

    def error(self) -> LineError:
        items = sorted(self.items, key=lambda item: _RANK.get(item[0], len(_RANK)))
        message = f"line {self.line}: " + "; ".join(msg for _, msg in items)
        return LineError(self.line, self.custom_id, items[0][0], message)


def _check_line(
    number: int,
    raw: bytes | str,
    seen: set[str],
    model: str | None,
    default_max: int | None,
    parser: str | None,
) -> JobRequest | LineError | None:
    problems = _Problems(number)

    def fail(code: str, message: str) -> LineError:
        problems.add(code, message)
        return problems.error()

    if isinstance(raw, bytes):
        if len(raw) > MAX_LINE_BYTES:
            return fail("line_too_long", _too_long(getattr(raw, "size", len(raw))))
        if not raw or raw.isspace():
            return None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            kind = next((k for magic, k in _NOT_TEXT if raw.startswith(magic)), None)
            if number == 1 and kind:  # every line fails alike: say why once, plainly
                return fail("invalid_encoding", f"the file is {kind}")
            return fail(
                "invalid_encoding",
                f"byte {exc.start + 1} is not UTF-8 ({raw[exc.start : exc.start + 1]!r}): "
                "save the file as UTF-8",
            )
    else:
        text = raw
        if (
            len(text) > MAX_LINE_BYTES // 4
            and len(text.encode("utf-8", "replace")) > MAX_LINE_BYTES
        ):
            return fail("line_too_long", _too_long(len(text.encode("utf-8", "replace"))))
        if not text or text.isspace():
            return None
    if number == 1 and text.startswith("\ufeff"):
        text = text[1:]  # a byte-order mark some editors write

    try:
        obj = _JSON.decode(text)
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, or an integer of 4,300+ digits
        digits = _TOO_MANY_DIGITS.search(str(exc))
        if digits:  # Python's own advice (sys.set_int_max_str_digits) is not the user's fix
            return fail(
                "invalid_json",
                f"a number has {digits.group(1)} digits, more than can be read: no request "
                "field takes a number that long; fix the number",
            )
        return fail(
            "invalid_json",
            f"not valid JSON ({exc}): write each request as one JSON object on one line",
        )
    except RecursionError:
        return fail(
            "invalid_json",
            "arrays or objects nest too deeply to read: a request needs only a few levels",
        )
    if not isinstance(obj, dict):
        return fail("not_an_object", f"a line must be a JSON object, got a JSON {_json_type(obj)}")
    surrogate = (
        _lone_surrogate_path(obj)
        if _SURROGATE_ESCAPE.search(text) or not isinstance(raw, bytes)
        else None
    )
    if surrogate is not None:
        custom_id = obj.get("custom_id")
        if isinstance(custom_id, str) and not _has_lone_surrogate(custom_id):
            problems.custom_id = custom_id if 0 < len(custom_id) <= MAX_CUSTOM_ID_LEN else None
        return fail(
            "invalid_encoding",
            f"{surrogate} holds a lone surrogate escape (\\ud800-\\udfff), which is not text: "
            "remove it, or write the character itself or a full surrogate pair",
        )

    custom_id = obj.get("custom_id")
    if isinstance(custom_id, str) and 0 < len(custom_id) <= MAX_CUSTOM_ID_LEN:
        problems.custom_id = custom_id
        if custom_id in seen:
            problems.add(
                "duplicate_custom_id",
                f"custom_id {shown(custom_id)} is already used by an earlier line: give each line its own custom_id",
            )
        seen.add(custom_id)

    try:
        line = BatchLine.model_validate(obj)
    except ValidationError as exc:
        line = None
        for err in exc.errors():
            _describe_line_error(err, obj, problems)
    url = obj.get("url") if line is None else line.url
    body = obj.get("body") if line is None else line.body
    if url not in URLS or not isinstance(body, dict):
        return problems.error()  # nothing more to check without a body of a known kind

    body_model = _check_body(url, body, model, problems)
    if problems.items:
        return problems.error()
    assert body_model is not None and problems.custom_id is not None  # no problems: both set
    if isinstance(body_model, EmbeddingBody):
        return JobRequest(
            line=number,
            custom_id=problems.custom_id,
            url=url,
            messages=None,
            prompt=None,
            params=EMBEDDING_PARAMS,
            logprobs=None,
            model=body_model.model,
            inputs=body_model.input,
            dimensions=body_model.dimensions,
            encoding_format=body_model.encoding_format or "float",
            num_inputs=len(body_model.input),
        )
    if isinstance(body_model, (ScoreBody, RerankBody)):
        return _score_request(number, problems.custom_id, url, body_model, fail)
    try:
        params = body_model.sampling_params(default_max)
    except ValueError as exc:
        return fail("invalid_parameter", str(exc))
    chat = isinstance(body_model, ChatCompletionBody)
    try:
        calling = body_model.tool_calling(parser) if chat else None
    except ValueError as exc:
        return fail("unsupported_parameter", str(exc))
    return JobRequest(
        line=number,
        custom_id=problems.custom_id,
        url=url,
        messages=body_model.message_dicts() if chat else None,
        prompt=None if chat else body_model.prompt,
        params=params,
        logprobs=params.logprobs,
        model=body_model.model,
        max_tokens=body_model.requested_max_tokens(),
        tools=body_model.tools if chat else None,
        tool_calling=calling,
        reasoning_effort=body_model.reasoning_effort if chat else None,
        chat_template_kwargs=body_model.chat_template_kwargs if chat else None,
    )


def _score_request(
    number: int, custom_id: str, url: str, body: ScoreBody | RerankBody, fail
) -> JobRequest | LineError:
    """A score or rerank line as its pairs: a rerank line's query against each document; a
    score line's texts paired as vLLM pairs them (engine/pooling/score_pairs.as_pairs)."""
    if isinstance(body, RerankBody):
        pairs, documents = [(body.query, d) for d in body.documents], body.documents
    else:
        try:
            pairs, documents = as_pairs(body.text_1, body.text_2), None
        except ValueError as exc:
            return fail("invalid_parameter", str(exc))
    return JobRequest(
        line=number,
        custom_id=custom_id,
        url=url,
        messages=None,
        prompt=None,
        params=EMBEDDING_PARAMS,
        logprobs=None,
        model=body.model,
        num_inputs=len(pairs),
        pairs=pairs,
        documents=documents,
        top_n=getattr(body, "top_n", None),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )


def _check_body(
    url: str, body: dict, model: str | None, problems: _Problems
) -> ChatCompletionBody | CompletionBody | EmbeddingBody | None:
    named = body.get("model")
    if model is not None and isinstance(named, str) and named != model:
        problems.add(
            "model_mismatch",
            f"'model' is {shown(named)} but this job runs {shown(model)}: set it to {shown(model)} or remove it",
        )
    cls = BODIES[url]
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        done: set[str] = set()
        for err in exc.errors():
            _describe_body_error(err, url, cls, body, problems, done)
        return None


# --- messages that say what to fix --------------------------------------------------------------


def _describe_line_error(err: dict[str, Any], obj: dict, problems: _Problems) -> None:
    loc, kind = err["loc"], err["type"]
    field = loc[0] if loc else ""
    rule = BatchLine.model_fields[field].description if field in BatchLine.model_fields else ""
    if kind == "missing":
        if field == "custom_id":
            problems.add("missing_custom_id", f"no 'custom_id': give each line a unique id, {rule}")
        else:
            problems.add(_line_field_code(field), f"no '{field}': it must be {rule}")
    elif kind == "extra_forbidden":
        problems.add(
            "unknown_parameter",
            f"unknown field '{field}' in the line: a line holds only custom_id, method, url and body",
        )
    else:
        problems.add(
            _line_field_code(field), f"'{field}' must be {rule}, got {shown(obj.get(field))}"
        )


def _line_field_code(field: object) -> str:
    """The code of a problem with a top-level field; an odd key pydantic reports oddly is
    still one record, never a crash."""
    return _LINE_FIELD_CODES.get(str(field), "unknown_parameter")


def _describe_body_error(
    err: dict[str, Any],
    url: str,
    cls: type[BaseModel],
    body: dict,
    problems: _Problems,
    done: set[str],
) -> None:
    loc, kind = err["loc"], err["type"]
    field = str(loc[0]) if loc else ""
    if field == "messages" and len(loc) > 1:
        problems.add("invalid_messages", _message_error(err))
        return
    if field in done:  # a union reports once per member; one message per field is enough
        return
    done.add(field)
    value = body.get(field)
    if kind == "missing":
        code = "missing_messages" if field == "messages" else "missing_prompt"
        rule = cls.model_fields[field].description
        problems.add(code, f"no '{field}': a {url} request needs '{field}', {rule}")
    elif kind == "extra_forbidden":
        problems.add("unknown_parameter", _unknown(field, url, cls))
    elif kind == "unsupported_parameter":
        problems.add(kind, f"'{field}' = {shown(value)} is not supported: {err['msg']}")
    elif kind == PARAMETER_RULE:  # a field's own check, whose message says what to fix
        problems.add("invalid_parameter", err["msg"])
    elif not loc:  # a check across fields
        problems.add(kind if kind in _RANK else "invalid_parameter", err["msg"])
    else:
        code = "invalid_messages" if field == "messages" else "invalid_parameter"
        problems.add(
            code, f"'{field}' must be {cls.model_fields[field].description}, got {shown(value)}"
        )


_MESSAGE_PHRASES = {
    "missing": "is missing",
    "extra_forbidden": "is not a message field kvbatch supports (a message holds role, content, name, tool_calls and tool_call_id)",
    "model_type": "must be an object with 'role' and 'content'",
    "dict_type": "must be an object with 'role' and 'content'",
    "string_type": "must be a string",
}


def _message_error(err: dict[str, Any]) -> str:
    path = "messages" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"][1:])
    kind = err["type"]
    phrase = err["msg"] if kind == "invalid_messages" else _MESSAGE_PHRASES.get(kind, err["msg"])
    if kind in ("missing", "extra_forbidden"):
        return f"'{path}' {phrase}"
    return f"'{path}' {phrase}, got {shown(err.get('input'))}"


def _unknown(field: str, url: str, cls: type[BaseModel]) -> str:
    message = f"unknown parameter '{field}' for {url}"
    other = next((c for u, c in BODIES.items() if u != url and field in c.model_fields), None)
    if other is not None:
        other_url = next(u for u, c in BODIES.items() if c is other)
        return message + f": it belongs to {other_url}; fix the url or remove it"
    close = difflib.get_close_matches(field, list(cls.model_fields), n=1)
    return message + (f": did you mean '{close[0]}'?" if close else ": remove it")


def _too_long(size: int) -> str:
    return (
        f"the line is {size} bytes, over the limit of {MAX_LINE_BYTES} bytes: shorten the "
        "prompt (or split the request)"
    )


# A JSON escape of a UTF-16 surrogate. Raw UTF-8 cannot hold one (the decoder refuses it), so
# a line without this pattern needs no walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate_path(obj: object) -> str | None:
    """Where the first string (key or value) with a lone surrogate is, as 'body.stop[0]', or
    None. Iterative: a line may nest as deep as the JSON reader allows."""
    stack: list[tuple[str, object]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _has_lone_surrogate(value):
                return f"'{path}'" if path else "the line"
        elif isinstance(value, dict):
            for key, item in value.items():
                if _has_lone_surrogate(key):
                    where = f"'{path}'" if path else "the line"
                    return f"a key of {where} ({ascii(key)})"
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


_JSON = json.JSONDecoder(parse_constant=_reject_constant)  # one decoder, not one per line
# Files a user may hand over instead of the JSONL itself, by their first bytes.
_NOT_TEXT = (
    (b"\x1f\x8b", "gzip-compressed: decompress it first (gunzip FILE.gz)"),
    (b"PK\x03\x04", "a zip archive: extract the .jsonl from it first"),
    (b"\xff\xfe", "UTF-16 text (Windows' 'Unicode'): save it as UTF-8"),
    (b"\xfe\xff", "UTF-16 text: save it as UTF-8"),
)
_TOO_MANY_DIGITS = re.compile(r"integer string conversion: value has (\d+) digits")


def _json_type(obj: object) -> str:
    if isinstance(obj, list):
        return "array"
    if isinstance(obj, str):
        return "string"
    if obj is None:
        return "null"
    return "boolean" if isinstance(obj, bool) else "number"

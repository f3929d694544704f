"""Output lines in OpenAI's batch output schema.

A success line::

    {"id": "batch_req_…", "custom_id": …, "error": null,
     "response": {"status_code": 200, "request_id": "req_…", "body": <chat.completion | text_completion>}}

An error line (a bad input line, a prompt the model cannot run, or a constrained answer that
completed but breaks its JSON schema: code `invalid_output`; one cut by max_tokens is a
success with finish_reason "length", as OpenAI writes it)::

    {"id": "batch_req_…", "custom_id": … | "kvbatch-line-N", "response": null,
     "error": {"code": …, "message": "line N: …", "line": N}}

Ids are hashes of (batch_id, line, custom_id): unique within a job, and the same when a shard
is run again, so a rerun writes identical lines. Tool calls' ids ("call_" + 24 hex digits, the
shape of vLLM's random ones) are hashes too, of that key and the call's place in the answer.

A chat line with tool calling (kvbatch.jobs.openai_format.tools) answers, when the model made calls::

    "message": {"role": "assistant", "content": null | <text outside the calls>,
                "tool_calls": [{"id": "call_…", "type": "function",
                                "function": {"name": …, "arguments": <JSON text>}}], …},
    "finish_reason": "tool_calls"     ("length" when max_tokens cut the answer)

A chat line on a reasoning model (the engine's reasoning parser: kvbatch.engine.reasoning)
answers with the reasoning apart, as vLLM writes it, and counts its tokens::

    "message": {"role": "assistant", "reasoning_content": <the reasoning> | null,
                "content": <the answer> | null (max_tokens reached inside the reasoning), …}
    "usage": {…, "completion_tokens_details": {"reasoning_tokens": N, …}}

A JSON schema's check reads the content; gpt-oss's calls come from its commentary channel.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import weakref
from typing import Any

from kvbatch.engine import (
    ReasoningParser,
    ReasoningSplit,
    RequestOutput,
    TokenLogprobs,
    bytes_to_unicode,
)
from kvbatch.jobs.openai_format.answer_schema import ANSWERS
from kvbatch.jobs.openai_format.tools import read_answer
from kvbatch.jobs.openai_format.validate import JobRequest, LineError

_FINISH_REASONS = {"stop": "stop", "length": "length"}  # engine -> OpenAI
_MIN_LOGPROB = -9999.0  # what OpenAI reports for an impossible token; JSON has no -inf


# A C++ library's log prefix inside an exception's text (xgrammar's "[03:23:04]
# /project/cpp/json_schema_converter.cc:5082: "): a clock time would make the error file of one
# input differ from run to run, and a build path tells the user nothing.
_NATIVE_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")


def refusal(message: str) -> str:
    """The engine's reason for refusing a request, as one line of an error record: no native
    log prefix, no newlines."""
    return " ".join(_NATIVE_LOG_PREFIX.sub("", message).split())


def success_line(
    req: JobRequest,
    out: RequestOutput,
    *,
    model: str,
    tokenizer,
    batch_id: str,
    created: int,
    reasoning: ReasoningParser | None = None,
) -> dict[str, Any]:
    """The output line of a request the engine ran. If the engine refused it (`out.error`),
    the error line (code invalid_prompt, or the engine's: context_length_exceeded) instead:
    check `line["error"]` to count it. `reasoning`: the model's reasoning parser (the
    engine's), which splits a chat answer into reasoning_content and content."""
    if out.error is not None:
        code = out.error_code or "invalid_prompt"
        return error_line(
            LineError(req.line, req.custom_id, code, f"line {req.line}: {refusal(out.error)}"),
            batch_id=batch_id,
        )
    splits = _splits(req, out, reasoning)
    broken = _schema_violation(req, out, splits)
    if broken is not None:
        return error_line(
            LineError(req.line, req.custom_id, "invalid_output", f"line {req.line}: {broken}"),
            batch_id=batch_id,
        )
    key = _key(batch_id, req.line, req.custom_id)
    tokens = _TokenTexts.of(tokenizer)
    choices = [
        _choice(req, c, tokens, key, splits.get(c.index))
        for c in sorted(out.outputs, key=lambda c: c.index)
    ]
    body_id, kind = (
        ("chatcmpl-", "chat.completion") if req.is_chat else ("cmpl-", "text_completion")
    )
    body_id += key
    body = {
        "id": body_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(out, sum(split.num_reasoning_tokens for split in splits.values())),
        "system_fingerprint": None,
    }
    return {
        "id": "batch_req_" + key,
        "custom_id": req.custom_id,
        "response": {"status_code": 200, "request_id": "req_" + key, "body": body},
        "error": None,
    }


def _splits(
    req: JobRequest, out: RequestOutput, reasoning: ReasoningParser | None
) -> dict[int, ReasoningSplit]:
    """Each chat choice's reasoning and answer, by choice index (none without a parser)."""
    if reasoning is None or not req.is_chat:
        return {}
    return {
        c.index: cut_at_stop(reasoning.split(out.prompt_token_ids, c.token_ids), c.stop_reason)
        for c in out.outputs
    }


def cut_at_stop(split: ReasoningSplit, stop: int | str | None) -> ReasoningSplit:
    """A split whose answer a stop string ended: the engine cut its text there, and the
    split, read from the tokens, is cut the same way (in the reasoning: no content)."""
    if not isinstance(stop, str):
        return split
    if split.content is not None and stop in split.content:
        return dataclasses.replace(split, content=split.content[: split.content.index(stop)])
    if split.reasoning is not None and stop in split.reasoning:
        reasoning = split.reasoning[: split.reasoning.index(stop)]
        return dataclasses.replace(split, reasoning=reasoning, content=None, calls=[])
    return split


def _schema_violation(
    req: JobRequest, out: RequestOutput, splits: dict[int, ReasoningSplit]
) -> str | None:
    """Why a completed choice of a constrained request breaks its schema, or None. A choice
    cut by max_tokens is not checked: it is written with finish_reason "length". A reasoning
    model's answer is its content, after the reasoning."""
    spec = req.params.structured_outputs
    if spec is None:
        return None
    for choice in out.outputs:
        if choice.finish_reason != "stop":
            continue
        split = splits.get(choice.index)
        answer = choice.text if split is None else (split.content or "")
        why = ANSWERS.violation(spec, answer)
        if why is not None:
            return (
                f"the answer (choice {choice.index}) does not follow its JSON schema: {why}. It "
                "is not written: decoding enforced only part of the schema (strict false), or a "
                "stop string cut the answer; docs/STRUCTURED_OUTPUTS.md lists what is enforced"
            )
    return None


def _choice(
    req: JobRequest, completion, tokens: _TokenTexts, key: str, split: ReasoningSplit | None
) -> dict[str, Any]:
    """One choice of the body: chat's message or completions' text, at the choice's index.
    A reasoning model's message carries `reasoning_content` (vLLM's field) beside `content`,
    which is null when max_tokens ended the answer inside the reasoning."""
    finish_reason = _FINISH_REASONS.get(completion.finish_reason or "")
    if finish_reason is None:
        raise ValueError(
            f"request {req.custom_id!r} has finish_reason {completion.finish_reason!r}: only "
            "finished requests (stop or length) can be written"
        )
    if req.is_chat:
        logprobs = None
        if completion.logprobs is not None:
            logprobs = {"content": _chat_logprobs(completion.logprobs, tokens), "refusal": None}
        text = completion.text if split is None else split.content
        message = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": [],
        }
        if split is not None:
            message["reasoning_content"] = split.reasoning
        calls = [(c.name, c.arguments) for c in split.calls] if split is not None else []
        if req.tool_calling is not None and not calls and text is not None:
            answer = read_answer(req.tool_calling, text)
            if answer.calls:
                message["content"] = answer.content
                calls = answer.calls
        if calls:
            message["tool_calls"] = [
                _tool_call(key, completion.index, i, name, arguments)
                for i, (name, arguments) in enumerate(calls)
            ]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return {
            "index": completion.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    logprobs = None
    if completion.logprobs is not None:
        logprobs = _completion_logprobs(completion.logprobs, tokens)
    return {
        "index": completion.index,
        "text": completion.text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def _tool_call(key: str, choice: int, i: int, name: str, arguments: str) -> dict[str, Any]:
    digest = hashlib.sha256(f"{key}\0{choice}\0{i}".encode()).hexdigest()[:24]
    return {
        "id": "call_" + digest,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def embedding_line(req: JobRequest, body: dict[str, Any], *, batch_id: str) -> dict[str, Any]:
    """The output line of an embeddings request: `body` is its CreateEmbeddingResponse (and
    of a score or rerank line, whose `body` is its ScoreResponse or RerankResponse)."""
    key = _key(batch_id, req.line, req.custom_id)
    return {
        "id": "batch_req_" + key,
        "custom_id": req.custom_id,
        "response": {"status_code": 200, "request_id": "req_" + key, "body": body},
        "error": None,
    }


def error_line(err: LineError, *, batch_id: str) -> dict[str, Any]:
    """The output line of a line that got no answer (a validation or prompt error). A line
    without a usable custom_id gets `placeholder_custom_id(line)` (vLLM's and OpenAI's line
    types need a string), and its message says so."""
    custom_id, message = err.custom_id, err.message
    if custom_id is None:
        custom_id = placeholder_custom_id(err.line)
        message += f" (the line has no usable custom_id: this record is named {custom_id!r})"
    return {
        "id": "batch_req_" + _key(batch_id, err.line, err.custom_id),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": err.code, "message": message, "line": err.line},
    }


def placeholder_custom_id(line: int) -> str:
    """The custom_id of the error record of input line `line` when the line gave none usable:
    the same on every run, and named after the line so it is easy to find."""
    return f"kvbatch-line-{line}"


def response_key(batch_id: str, line: int, custom_id: str | None) -> str:
    """The key of a line's ids (batch_req_<key>, req_<key>, score-<key>): the same however
    the job was split between workers."""
    return _key(batch_id, line, custom_id)


def _key(batch_id: str, line: int, custom_id: str | None) -> str:
    # custom_id alone is not unique among error lines (duplicates, missing ids); the line is.
    data = f"{batch_id}\0{line}\0{custom_id or ''}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()[:32]


def _usage(out: RequestOutput, reasoning_tokens: int = 0) -> dict[str, Any]:
    prompt = len(out.prompt_token_ids)  # once: the choices share the prompt, as OpenAI counts
    completion = sum(len(choice.token_ids) for choice in out.outputs)
    spec = getattr(out, "spec_stats", None)  # speculative decoding's draft tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning_tokens,
            "accepted_prediction_tokens": spec.num_accepted_tokens if spec else 0,
            "rejected_prediction_tokens": spec.num_rejected_tokens if spec else 0,
        },
    }


# --- logprobs ---------------------------------------------------------------------------------


def _chat_logprobs(steps: list[TokenLogprobs], tokens: _TokenTexts) -> list[dict[str, Any]]:
    content = []
    for step in steps:
        text, raw = tokens.get(step.token_id)
        top = []
        for token_id, logprob in step.top:
            top_text, top_raw = tokens.get(token_id)
            top.append({"token": top_text, "logprob": _finite(logprob), "bytes": top_raw})
        content.append(
            {"token": text, "logprob": _finite(step.logprob), "bytes": raw, "top_logprobs": top}
        )
    return content


def _completion_logprobs(steps: list[TokenLogprobs], tokens: _TokenTexts) -> dict[str, Any]:
    texts, chosen, tops, offsets = [], [], [], []
    offset = 0
    for step in steps:
        text = tokens.get(step.token_id)[0]
        top: dict[str, float] = {}
        for token_id, logprob in step.top:
            top.setdefault(tokens.get(token_id)[0], _finite(logprob))
        # OpenAI: "the API will always return the logprob of the sampled token", so up to
        # logprobs + 1 entries.
        top.setdefault(text, _finite(step.logprob))
        texts.append(text)
        chosen.append(_finite(step.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


class _TokenTexts:
    """Each token id's text and exact bytes, cached per tokenizer.

    The text is `decode([id])`; the bytes are the token's own bytes where the vocabulary
    tells them (byte-level BPE, `<0xNN>` byte tokens), so a token holding half of a UTF-8
    character reports its real bytes, not those of U+FFFD as its decoded text would.
    """

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self.byte_level = decoder is not None and "ByteLevel" in repr(decoder)

    @classmethod
    def of(cls, tokenizer) -> _TokenTexts:
        try:
            found = cls._cache.get(tokenizer)
            if found is None:
                found = cls._cache[tokenizer] = cls(tokenizer)
            return found
        except TypeError:  # not weakly referenceable: no cache
            return cls(tokenizer)

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self.texts.get(token_id)
        if found is None:
            text = self.tokenizer.decode([token_id])
            found = self.texts[token_id] = (text, list(self._bytes(token_id, text)))
        return found

    def _bytes(self, token_id: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            if self.byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return text.encode("utf-8", "surrogatepass")


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}

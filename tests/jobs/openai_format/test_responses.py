"""Output lines parse with the `openai` package's own types, and hold exactly their fields."""

from __future__ import annotations

import json

import pytest
from openai import BaseModel as OpenAIModel
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion

from kvbatch.engine import TokenLogprobs
from kvbatch.engine.core.outputs import CompletionOutput, RequestOutput
from kvbatch.jobs.openai_format.responses import error_line, success_line
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, validate_lines

MODEL = "SmolLM2-135M-Instruct"
LINE_KEYS = {"id", "custom_id", "response", "error"}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def request(url: str, custom_id: str = "req-1", **body) -> JobRequest:
    raw = json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
    [req] = validate_lines([raw])
    assert isinstance(req, JobRequest), req
    return req


def output(
    tokenizer,
    text: str,
    *,
    logprobs: int | None = None,
    finish_reason: str = "stop",
    cached: int = 0,
) -> RequestOutput:
    ids = tokenizer.encode(text)
    steps = None
    if logprobs is not None:
        # Each position: the chosen token, then `logprobs` alternatives (the chosen one first).
        steps = [
            TokenLogprobs(
                t, -0.25 * i, [(t, -0.25 * i), (t + 1, -3.0), (t + 2, float("-inf"))][:logprobs]
            )
            for i, t in enumerate(ids)
        ]
    return RequestOutput(
        request_id="0",
        prompt=None,
        prompt_token_ids=list(range(1, 21)),
        outputs=[CompletionOutput(0, text, ids, finish_reason, None, steps)],
        finished=True,
        num_cached_tokens=cached,
    )


def no_extra_fields(model: OpenAIModel, where: str = "body") -> None:
    """The openai models accept unknown fields; an exact schema has none, at any depth."""
    assert not model.model_extra, f"{where} has fields OpenAI does not: {model.model_extra}"
    for name in model.model_fields_set:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, OpenAIModel):
                no_extra_fields(item, f"{where}.{name}[{i}]")


def strict_json(line: dict) -> dict:
    return json.loads(json.dumps(line, allow_nan=False))  # -inf would not be JSON


def test_chat_line(tokenizer):
    req = request("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}])
    line = strict_json(
        success_line(
            req,
            output(tokenizer, "Hello there!", cached=16),
            model=MODEL,
            tokenizer=tokenizer,
            batch_id="batch_1",
            created=1_700_000_000,
        )
    )
    assert set(line) == LINE_KEYS and line["error"] is None and line["custom_id"] == "req-1"
    assert line["id"].startswith("batch_req_")
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
    body = ChatCompletion.model_validate(response["body"])
    no_extra_fields(body)
    assert body.object == "chat.completion" and body.id.startswith("chatcmpl-")
    assert (body.model, body.created) == (MODEL, 1_700_000_000)
    [choice] = body.choices
    assert choice.message.content == "Hello there!" and choice.message.role == "assistant"
    assert choice.finish_reason == "stop" and choice.logprobs is None
    n = len(tokenizer.encode("Hello there!"))
    assert (body.usage.prompt_tokens, body.usage.completion_tokens) == (20, n)
    assert body.usage.total_tokens == 20 + n
    assert body.usage.prompt_tokens_details.cached_tokens == 16
    assert body.usage.completion_tokens_details.reasoning_tokens == 0


def test_completion_line(tokenizer):
    req = request("/v1/completions", prompt="Once upon", logprobs=2)
    text = " a time, there was"
    line = strict_json(
        success_line(
            req,
            output(tokenizer, text, logprobs=2, finish_reason="length"),
            model=MODEL,
            tokenizer=tokenizer,
            batch_id="batch_1",
            created=1,
        )
    )
    body = Completion.model_validate(line["response"]["body"])
    no_extra_fields(body)
    assert body.object == "text_completion" and body.id.startswith("cmpl-")
    [choice] = body.choices
    assert choice.text == text and choice.finish_reason == "length" and choice.index == 0
    lp = choice.logprobs
    ids = tokenizer.encode(text)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert "".join(lp.tokens) == text
    assert lp.token_logprobs == [-0.25 * i for i in range(len(ids))]
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    assert lp.top_logprobs[1] == {lp.tokens[1]: -0.25, tokenizer.decode([ids[1] + 1]): -3.0}
    assert body.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_logprobs_with_exact_bytes(tokenizer):
    # "🦙" is three byte-level tokens, none of them a whole character: each decodes to U+FFFD,
    # but their bytes must join into the emoji's UTF-8.
    text = "I love 🦙!"
    req = request(
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        top_logprobs=3,
    )
    line = strict_json(
        success_line(
            req,
            output(tokenizer, text, logprobs=3),
            model=MODEL,
            tokenizer=tokenizer,
            batch_id="b",
            created=1,
        )
    )
    body = ChatCompletion.model_validate(line["response"]["body"])
    no_extra_fields(body)
    content = body.choices[0].logprobs.content
    assert len(content) == len(tokenizer.encode(text))
    assert bytes(b for item in content for b in item.bytes) == text.encode()
    assert any(item.token == "\ufffd" for item in content)
    first = content[0]
    assert first.token == "I" and first.logprob == 0.0
    assert [t.logprob for t in first.top_logprobs] == [0.0, -3.0, -9999.0]  # -inf -> -9999
    assert first.top_logprobs[0].token == "I"


def test_chat_logprobs_without_alternatives(tokenizer):
    req = request(
        "/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], logprobs=True
    )
    assert req.logprobs == 0
    line = success_line(
        req,
        output(tokenizer, "Yes", logprobs=0),
        model=MODEL,
        tokenizer=tokenizer,
        batch_id="b",
        created=1,
    )
    content = ChatCompletion.model_validate(line["response"]["body"]).choices[0].logprobs.content
    assert [c.top_logprobs for c in content] == [[] for _ in content]


def test_ids_are_deterministic_and_unique(tokenizer):
    def ids(batch_id: str, custom_id: str) -> tuple[str, str, str]:
        req = request("/v1/completions", custom_id, prompt="x")
        line = success_line(
            req,
            output(tokenizer, "y"),
            model=MODEL,
            tokenizer=tokenizer,
            batch_id=batch_id,
            created=1,
        )
        return line["id"], line["response"]["request_id"], line["response"]["body"]["id"]

    assert ids("b1", "a") == ids("b1", "a")
    seen = {i for key in [("b1", "a"), ("b1", "b"), ("b2", "a")] for i in ids(*key)}
    assert len(seen) == 9


def test_error_line():
    err = LineError(7, None, "invalid_json", "line 7: not valid JSON")
    line = strict_json(error_line(err, batch_id="b"))
    assert set(line) == LINE_KEYS and line["response"] is None
    assert line["custom_id"] == "kvbatch-line-7"  # a placeholder, the same on every run
    error = BatchError.model_validate(line["error"])
    no_extra_fields(error, "error")
    assert (error.code, error.line) == ("invalid_json", 7)
    assert error.message == (
        "line 7: not valid JSON (the line has no usable custom_id: this record is named "
        "'kvbatch-line-7')"
    )
    # Two lines with the same custom_id (a duplicate) still get distinct ids.
    dup = [LineError(n, "a", "duplicate_custom_id", "dup") for n in (3, 4)]
    assert len({error_line(e, batch_id="b")["id"] for e in dup}) == 2


def test_engine_error_becomes_an_error_line(tokenizer):
    req = request("/v1/completions", "bad", prompt="x")
    out = output(tokenizer, "")
    out.error = "the prompt has 9000 tokens but the model's context is max_model_len=8192"
    line = success_line(req, out, model=MODEL, tokenizer=tokenizer, batch_id="b", created=1)
    assert line["response"] is None and line["custom_id"] == "bad"
    assert line["error"]["code"] == "invalid_prompt" and line["error"]["line"] == 1
    assert line["error"]["message"].startswith("line 1: the prompt has 9000 tokens")


def test_unfinished_output_is_refused(tokenizer):
    req = request("/v1/completions", prompt="x")
    with pytest.raises(ValueError, match="finish_reason"):
        success_line(
            req,
            output(tokenizer, "y", finish_reason=None),
            model=MODEL,
            tokenizer=tokenizer,
            batch_id="b",
            created=1,
        )

"""Chat lines of a harmony model (gpt-oss) turned into output lines, on token streams written
by hand with openai-harmony's own encoding: reasoning_content from the analysis channel,
content from final, tool_calls from commentary to functions.NAME; reasoning_effort in the
prompt's system message. Every body is an openai ChatCompletion."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion

from kvbatch.engine import CompletionOutput, RequestOutput
from kvbatch.engine.reasoning.harmony import HarmonyParser
from kvbatch.engine.reasoning.harmony_prompt import render_harmony_prompt
from kvbatch.engine.reasoning.harmony_vocab import harmony_encoding
from kvbatch.jobs.openai_format.prompts import prompt_token_ids
from kvbatch.jobs.openai_format.responses import success_line
from kvbatch.jobs.openai_format.validate import JobRequest, validate_lines

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def encoding():
    return harmony_encoding()


def request(**body) -> JobRequest:
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Weather in Paris?"}], **body},
    }
    [req] = validate_lines([json.dumps(line)], tool_call_parser="openai")
    assert isinstance(req, JobRequest), req
    return req


def line_of(req: JobRequest, encoding, text: str, finish: str) -> dict:
    prompt = prompt_token_ids(req, None, 4096, "openai_gptoss")
    output = encoding.encode(text, allowed_special="all")
    stop = output[-1] if finish == "stop" else None
    out = RequestOutput(
        "0:0",
        None,
        prompt,
        [CompletionOutput(0, encoding.decode(output), output, finish, stop)],
        finished=True,
    )
    line = success_line(
        req, out, model="gpt-oss", tokenizer=None, batch_id="b", created=1,
        reasoning=HarmonyParser(encoding),
    )  # fmt: skip
    ChatCompletion.model_validate(line["response"]["body"])
    return line


def test_reasoning_and_final(encoding):
    text = (
        "<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant"
        "<|channel|>final<|message|>It is sunny.<|return|>"
    )
    body = line_of(request(), encoding, text, "stop")["response"]["body"]
    [choice] = body["choices"]
    assert choice["message"]["reasoning_content"] == "User wants weather."
    assert choice["message"]["content"] == "It is sunny."
    assert choice["finish_reason"] == "stop"
    analysis = encoding.encode(
        "<|channel|>analysis<|message|>User wants weather.<|end|>", allowed_special="all"
    )
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(analysis)


def test_commentary_to_a_function_is_a_tool_call(encoding):
    text = (
        "<|channel|>analysis<|message|>Call the tool.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
    )
    req = request(tools=[WEATHER])
    [choice] = line_of(req, encoding, text, "stop")["response"]["body"]["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_max_tokens_inside_the_analysis(encoding):
    text = "<|channel|>analysis<|message|>The user asks about the weat"
    body = line_of(request(max_tokens=12), encoding, text, "length")["response"]["body"]
    [choice] = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "The user asks about the weat"
    usage = body["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"]


def test_reasoning_effort_reaches_the_system_message(encoding):
    for effort in ("low", "medium", "high"):
        ids = prompt_token_ids(request(reasoning_effort=effort), None, 4096, "openai_gptoss")
        assert f"Reasoning: {effort}" in encoding.decode(ids)
    default = prompt_token_ids(request(), None, 4096, "openai_gptoss")
    assert default == render_harmony_prompt([{"role": "user", "content": "Weather in Paris?"}])
    assert "Reasoning: medium" in encoding.decode(default)


def test_bad_reasoning_effort_is_a_line_error():
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "max"},
    }
    [error] = validate_lines([json.dumps(line)])
    assert error.code == "invalid_parameter" and "reasoning_effort" in error.message
    line["body"]["reasoning_effort"] = "low"
    line["body"]["chat_template_kwargs"] = "enable_thinking"
    [error] = validate_lines([json.dumps(line)])
    assert error.code == "invalid_parameter" and "chat_template_kwargs" in error.message

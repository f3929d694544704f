"""Strict structured outputs in job lines: a schema keyword decoding cannot enforce is the
line's error (naming it) unless the line sets strict false; and a completed answer that breaks
its schema is an error record, never a success."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbatch.engine.structured.enforced import unenforced
from kvbatch.jobs.openai_format.responses import success_line
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, validate_lines
from tests.engine.structured.schema_strategies import json_schemas, keywords_in
from tests.jobs.openai_format.test_responses import MODEL, output, tokenizer  # noqa: F401

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Give JSON"}]
NAME = {"type": "string"}


def line(schema: dict, strict: bool | None = None, **body) -> bytes:
    spec: dict = {"name": "s", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    body = {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": spec}}
    return json.dumps({"custom_id": "r", "method": "POST", "url": CHAT, "body": body}).encode()


def obj(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


# The hostile trial's schemas: each was run unenforced, with status 200.
UNENFORCED = [
    ("uniqueItems", obj(a={"type": "array", "items": {"type": "integer"}, "uniqueItems": True})),
    ("contains", obj(a={"type": "array", "contains": {"const": 1}, "minContains": 1})),
    ("if", {**obj(a=NAME), "if": {"required": ["a"]}, "then": {"required": ["b"]}}),
    ("dependentRequired", {**obj(a=NAME), "dependentRequired": {"a": ["b"]}}),
    ("not", obj(a={"not": {"type": "string"}})),
    ("allOf", obj(a={"allOf": [{"type": "string"}, {"type": "integer"}]})),
    ("maxLength", obj(a={"type": "string", "format": "email", "maxLength": 8})),
    ("$ref", obj(a={"$ref": "http://example.com/schema.json"})),
    ("$ref", obj(a={"$ref": "other.json"})),
    ("$ref", obj(a={"$ref": "file:///etc/passwd"})),
]


@pytest.mark.parametrize(("keyword", "schema"), UNENFORCED)
def test_strict_lines_name_the_keyword(keyword: str, schema: dict) -> None:
    for strict in (True, None):  # strict is kvbatch's default: it always constrains decoding
        [err] = validate_lines([line(schema, strict)])
        assert isinstance(err, LineError), err
        assert err.code == "unsupported_parameter"
        assert f"keyword {keyword!r}" in err.message and "strict" in err.message, err.message
    [req] = validate_lines([line(schema, False)])  # opted out: it runs, checked afterwards
    assert isinstance(req, JobRequest) and req.params.structured_outputs is not None


def test_an_invalid_schema_is_the_lines_error() -> None:
    [err] = validate_lines([line({"type": "object", "properties": {"a": {"type": 5}}})])
    assert isinstance(err, LineError) and "not a valid JSON Schema" in err.message


def test_forced_tools_are_strict_unless_the_function_opts_out() -> None:
    params = {"type": "object", "properties": {"x": {"not": {"type": "null"}}}}

    def tool_line(strict: bool | None) -> bytes:
        function: dict = {"name": "f", "parameters": params}
        if strict is not None:
            function["strict"] = strict
        body = {
            "messages": MESSAGES,
            "tools": [{"type": "function", "function": function}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
        return json.dumps({"custom_id": "t", "method": "POST", "url": CHAT, "body": body}).encode()

    [err] = validate_lines([tool_line(True)])
    assert isinstance(err, LineError) and err.code == "unsupported_parameter"
    assert "(f) parameters" in err.message and "keyword 'not'" in err.message
    [req] = validate_lines([tool_line(False)])
    assert isinstance(req, JobRequest)


def _answer(req: JobRequest, tokenizer, text: str, finish: str = "stop") -> dict:  # noqa: F811
    out = output(tokenizer, text, finish_reason=finish)
    return success_line(req, out, model=MODEL, tokenizer=tokenizer, batch_id="b", created=0)


def test_answers_are_validated_before_they_are_written(tokenizer) -> None:  # noqa: F811
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    [req] = validate_lines([line(schema, strict=False)])
    assert _answer(req, tokenizer, "[1, 2]")["error"] is None
    bad = _answer(req, tokenizer, "[1, 1]")
    assert bad["response"] is None and bad["error"]["code"] == "invalid_output"
    assert "uniqueItems" in bad["error"]["message"] and bad["error"]["line"] == 1
    # cut by max_tokens: incomplete by nature, written as OpenAI writes it
    cut = _answer(req, tokenizer, "[1, 1", finish="length")
    assert cut["response"]["body"]["choices"][0]["finish_reason"] == "length"


def test_formats_and_json_object_are_checked(tokenizer) -> None:  # noqa: F811
    [req] = validate_lines([line(obj(a={"type": "string", "format": "date"}), strict=False)])
    assert _answer(req, tokenizer, '{"a": "2020-02-28"}')["error"] is None
    assert _answer(req, tokenizer, '{"a": "2020-02-31"}')["error"]["code"] == "invalid_output"
    raw = {"messages": MESSAGES, "response_format": {"type": "json_object"}}
    [req] = validate_lines(
        [json.dumps({"custom_id": "o", "method": "POST", "url": CHAT, "body": raw})]
    )
    assert _answer(req, tokenizer, '{"k": 1}')["error"] is None
    assert _answer(req, tokenizer, '{"k": ')["error"]["code"] == "invalid_output"


def test_a_remote_ref_is_never_fetched_when_checking(tokenizer) -> None:  # noqa: F811
    schema = obj(a={"$ref": "http://127.0.0.1:9/schema.json"})
    [req] = validate_lines([line(schema, strict=False)])
    bad = _answer(req, tokenizer, '{"a": 1}')
    assert bad["error"]["code"] == "invalid_output"
    assert "cannot check" in bad["error"]["message"]


@settings(max_examples=200, deadline=None, database=None)
@given(schema=json_schemas(), strict=st.sampled_from([True, None, False]))
def test_job_lines_with_any_schema(schema: dict, strict: bool | None) -> None:
    """A line's schema drawn with every keyword of draft 2020-12: a strict line runs only
    what the grammar enforces and otherwise names the keyword; an opted-out line runs any
    valid schema."""
    [out] = validate_lines([line(schema, strict)])
    if isinstance(out, LineError):
        if out.code == "unsupported_parameter":
            assert strict is not False
            keyword = re.search(r"keyword '([^']+)'", out.message)
            assert keyword and keyword.group(1) in keywords_in(schema), out.message
        else:
            assert "not a valid JSON Schema" in out.message, out.message
        return
    assert strict is False or unenforced(schema) is None

"""Tool calling in chat lines: the tools and tool_choice checks, the Hermes parser on texts, the
chat template rendering of tools, tool calls and tool results (against transformers' own
`apply_chat_template`), and the answer's tool_calls as the openai SDK reads them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from kvbatch.engine.core.outputs import CompletionOutput, RequestOutput
from kvbatch.jobs.openai_format.prompts import PromptError, prompt_token_ids
from kvbatch.jobs.openai_format.responses import success_line
from kvbatch.jobs.openai_format.tool_parsers import HermesParser, ParsedCall, get_parser
from kvbatch.jobs.openai_format.tools import ToolCalling, read_answer
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, validate_lines
from tests.jobs.qwen_tool_template import QWEN_TOOL_TEMPLATE

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters at all
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def check(body: dict, parser: str | None = None) -> JobRequest | LineError:
    line = {"custom_id": "x", "method": "POST", "url": CHAT, "body": body}
    [record] = validate_lines([json.dumps(line)], tool_call_parser=parser)
    return record


# -- the Hermes parser -------------------------------------------------------------------------


def test_hermes_reads_several_calls_and_keeps_the_text_around_them():
    text = (
        "Let me check both.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>\nDone.'
    )
    parsed = HermesParser().parse(text)
    assert parsed.calls == [
        ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}'),
        ParsedCall("get_weather", '{"city": "Zürich"}'),  # non-ASCII kept, as vLLM's
    ]
    assert parsed.content == "Let me check both.\nDone."


def test_hermes_reads_a_last_call_left_open_and_no_text_as_no_content():
    parsed = get_parser("hermes").parse('<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    assert parsed.calls == [ParsedCall("get_time", "{}")] and parsed.content is None


@pytest.mark.parametrize(
    "text",
    [
        "no calls at all",
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>[1]</tool_call>',
    ],
)
def test_hermes_leaves_text_without_well_formed_calls_as_content(text: str):
    parsed = HermesParser().parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_an_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("mistral")


# -- answers -----------------------------------------------------------------------------------


def test_required_answers_become_calls_and_a_cut_one_stays_content():
    spec = ToolCalling("required")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    answer = read_answer(spec, text)
    assert answer.calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert answer.content is None
    assert read_answer(ToolCalling("required", parallel=False), text).calls[1:] == []
    assert read_answer(spec, '[{"name": "get_weath').calls == []


def test_tool_call_bodies_validate_as_openai_chat_completions():
    req = check({"messages": USER, "tools": [WEATHER, TIME]}, parser="hermes")
    assert isinstance(req, JobRequest)
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    out = RequestOutput(
        request_id="0",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        outputs=[
            CompletionOutput(0, text, [5, 6], finish_reason="stop"),
            CompletionOutput(1, "Just text.", [7], finish_reason="stop"),
        ],
        finished=True,
    )
    line = success_line(req, out, model="m", tokenizer=None, batch_id="b", created=1)
    again = success_line(req, out, model="m", tokenizer=None, batch_id="b", created=1)
    assert line == again  # call ids are stable: a rerun writes the same line
    body = ChatCompletion.model_validate(line["response"]["body"])
    called, plain = body.choices
    assert called.finish_reason == "tool_calls" and called.message.content == "Checking."
    [call] = called.message.tool_calls
    assert call.id.startswith("call_") and len(call.id) == 5 + 24
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None
    assert plain.message.content == "Just text."


# -- checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "required": "a"},
                        },
                    }
                ]
            },
            "invalid_parameter",
            ["'tools[0]' (f)", "not a valid JSON Schema"],
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "invalid_parameter",
            ["'tools[0]' (f)", "JSON Schema object"],
        ),
        ({"tools": [{"type": "function"}]}, "invalid_parameter", ["'tools[0]'"]),
        ({"tools": [{"type": "code_interpreter"}]}, "invalid_parameter", ["functions only"]),
        ({"tools": [WEATHER, WEATHER]}, "invalid_parameter", ["two tools are named"]),
        ({"tool_choice": "required"}, "invalid_parameter", ["needs 'tools'"]),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "invalid_parameter",
            ["'x'", "'get_weather'"],
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "invalid_parameter", ["'required'"]),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "invalid_parameter",
            ["response_format"],
        ),
        ({"tools": [WEATHER]}, "unsupported_parameter", ["--tool-call-parser hermes"]),
        ({"functions": [{"name": "f"}]}, "unsupported_parameter", ["'tools'"]),
    ],
)
def test_bad_tool_requests_are_refused_per_line_saying_what_to_fix(body, code, words):
    record = check({"messages": USER, **body})
    assert isinstance(record, LineError) and record.code == code, record
    for word in words:
        assert word in record.message, record.message


@pytest.mark.parametrize(
    "messages",
    [
        [*USER, {"role": "tool", "content": "x"}],  # no tool_call_id
        [*USER, {"role": "user", "content": "x", "tool_call_id": "c"}],
        [*USER, {"role": "assistant", "content": None}],
        [*USER, {"role": "assistant", "content": "x", "tool_calls": []}],
        [
            *USER,
            {
                **HISTORY[1],
                "tool_calls": [
                    {**HISTORY[1]["tool_calls"][0], "function": {"name": "f", "arguments": "{oops"}}
                ],
            },
        ],  # fmt: skip
        [*USER, {"role": "function", "name": "f", "content": "x"}],
    ],
)
def test_malformed_tool_messages_are_invalid_messages(messages):
    record = check({"messages": messages, "tools": [WEATHER], "tool_choice": "none"})
    assert isinstance(record, LineError) and record.code == "invalid_messages", record


def test_forced_choices_constrain_the_output_as_vllm_does():
    named = check(
        {
            "messages": USER,
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    assert json.loads(named.params.structured_outputs.json_schema) == {
        "type": "object",
        "properties": {},
    }
    assert named.tool_calling == ToolCalling("named", name="get_time")
    required = check(
        {
            "messages": USER,
            "tools": [WEATHER, TIME],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
    )
    schema = json.loads(required.params.structured_outputs.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    plain = check({"messages": USER, "tools": [WEATHER], "tool_choice": "none"})
    assert plain.tool_calling is None and plain.params.structured_outputs is None
    assert plain.tools == [WEATHER]  # still shown to the template, as vLLM does


# -- rendering ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_tools_calls_and_results_render_as_transformers_renders_them(tokenizer):
    req = check({"messages": HISTORY, "tools": [WEATHER], "tool_choice": "required"})
    ids = prompt_token_ids(req, tokenizer_with(tokenizer, QWEN_TOOL_TEMPLATE), 2048)
    expected = [
        *HISTORY[:1],
        {
            **HISTORY[1],
            "content": "",
            "tool_calls": [
                {
                    **HISTORY[1]["tool_calls"][0],
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },  # fmt: skip
        HISTORY[2],
    ]
    want = tokenizer.apply_chat_template(
        expected,
        tools=[WEATHER],
        chat_template=QWEN_TOOL_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    text = tokenizer.decode(ids)
    assert text == want
    assert '"arguments": {"city": "Paris"}' in text  # an object, not a quoted JSON text
    assert '"description": "The weather in a city"' in text and "sunny, 21 C" in text


def test_a_template_without_tool_support_is_refused_naming_the_fix(tokenizer):
    for body in (
        {"messages": USER, "tools": [WEATHER], "tool_choice": "required"},
        {"messages": HISTORY},
    ):
        with pytest.raises(PromptError, match="supports tools") as err:
            prompt_token_ids(check(body), tokenizer, 2048)  # SmolLM2's plain ChatML template
        assert err.value.code == "invalid_prompt"
    # tool_choice "none" asks for a plain answer: a template that drops the tools is fine
    assert prompt_token_ids(check({"messages": USER, "tools": [WEATHER], "tool_choice": "none"}),
                            tokenizer, 2048)  # fmt: skip


def tokenizer_with(tokenizer, template: str):
    """A copy of `tokenizer` whose chat template is `template`."""
    other = copy.copy(tokenizer)
    other.chat_template = template
    return other


def test_required_lifts_each_tools_defs_to_the_root_and_refuses_a_clash():
    def tool(name: str, city: dict) -> dict:
        parameters = {
            "type": "object",
            "properties": {"where": {"$ref": "#/$defs/City"}},
            "$defs": {"City": city},
        }
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    city = {"type": "string", "enum": ["Paris", "Rome"]}
    req = check({"messages": USER, "tools": [tool("a", city), tool("b", city)], "tool_choice": "required"})  # fmt: skip
    schema = json.loads(req.params.structured_outputs.json_schema)
    assert schema["$defs"] == {"City": city}
    assert all("$defs" not in item["properties"]["parameters"] for item in schema["items"]["anyOf"])
    clash = check({"messages": USER, "tools": [tool("a", city), tool("b", {"type": "integer"})], "tool_choice": "required"})  # fmt: skip
    assert isinstance(clash, LineError) and clash.code == "invalid_parameter"
    assert "'$defs.City'" in clash.message


def test_auto_is_refused_when_the_tokenizer_hides_the_parsers_tags(smollm2_dir: Path):
    """Answers skip special tokens: a tokenizer that marks <tool_call> special (as some Hermes
    checkpoints do) would hide every call from the parser, so such lines are refused."""
    from transformers import AutoTokenizer

    plain, special = (AutoTokenizer.from_pretrained(smollm2_dir) for _ in range(2))
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    req = check({"messages": USER, "tools": [WEATHER]}, parser="hermes")
    for tokenizer in (plain, special):
        tokenizer.chat_template = QWEN_TOOL_TEMPLATE
    assert prompt_token_ids(req, plain, 2048)  # plain text tags: readable
    with pytest.raises(PromptError, match="'required'") as err:
        prompt_token_ids(req, special, 2048)
    assert "<tool_call>" in err.value.message and err.value.code == "invalid_prompt"

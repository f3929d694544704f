"""n, penalties, logit_bias and response_format: validated per line, mapped to SamplingParams,
and answered through `kvbatch run` (n choices, usage over all of them, JSON that parses)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import given as hypothesis_given
from hypothesis import settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion

from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.structured.params import StructuredOutputs
from kvbatch.jobs.distributed.shards import ShardRequest
from kvbatch.jobs.local.run import RunOptions, run_job
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, validate_lines
from tests.jobs.local.test_run import MODEL_NAME, chat, completion, llm, write_jsonl  # noqa: F401

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "string", "enum": ["small", "large"]},
        "count": {"type": "integer"},
    },
    "required": ["name", "size", "count"],
    "additionalProperties": False,
}


def record(body: dict, url: str = "/v1/chat/completions") -> JobRequest | LineError:
    line = {"custom_id": "x", "method": "POST", "url": url, "body": body}
    [out] = validate_lines([json.dumps(line)])
    return out


# -- validation and mapping -------------------------------------------------------------------


def test_fields_map_to_sampling_params():
    req = record(
        {
            "messages": USER,
            "n": 3,
            "seed": 5,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "logit_bias": {"50256": -100, "7": 2.5},
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
            },
        }
    )
    assert isinstance(req, JobRequest), req
    p = req.params
    assert (p.n, p.seed, p.presence_penalty, p.frequency_penalty) == (3, 5, 0.5, -1.0)
    assert p.repetition_penalty == 1.2
    assert p.logit_bias == {50256: -100.0, 7: 2.5}
    assert p.structured_outputs == StructuredOutputs(json_schema=SCHEMA)


@pytest.mark.parametrize(
    ("response_format", "want"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, StructuredOutputs(json_object=True)),
        (
            {"type": "json_schema", "json_schema": {"name": "n"}},
            StructuredOutputs(json_object=True),
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": SCHEMA, "strict": False},
            },
            StructuredOutputs(json_schema=SCHEMA),
        ),
    ],
)
def test_response_formats(response_format, want):
    req = record({"messages": USER, "response_format": response_format})
    assert isinstance(req, JobRequest), req
    assert req.params.structured_outputs == want


def test_completions_take_n_and_penalties_but_no_response_format():
    req = record({"prompt": "a", "n": 2, "presence_penalty": 1}, url="/v1/completions")
    assert isinstance(req, JobRequest) and req.params.n == 2
    err = record({"prompt": "a", "response_format": {"type": "json_object"}}, url="/v1/completions")
    assert isinstance(err, LineError) and err.code == "unknown_parameter"


def test_bodies_without_the_new_fields_map_as_before():
    req = record({"messages": USER, "temperature": 0, "max_tokens": 5})
    assert req.params == SamplingParams(max_tokens=5, temperature=0)
    neutral = record(
        {
            "messages": USER,
            "temperature": 0,
            "max_tokens": 5,
            "n": 1,
            "presence_penalty": 0,
            "frequency_penalty": 0,
            "repetition_penalty": 1,
            "logit_bias": {},
            "response_format": {"type": "text"},
        }
    )
    assert neutral.params == req.params


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("n", 0, "'n' must be an integer between 1 and 128, got 0"),
        ("n", 129, "between 1 and 128"),
        ("presence_penalty", 2.5, "'presence_penalty' must be a number between -2 and 2"),
        ("frequency_penalty", "1", "'frequency_penalty' must be a number between -2 and 2"),
        ("repetition_penalty", 0, "'repetition_penalty' must be a number between 1e-30 and 1e+30"),
        ("repetition_penalty", 1e-46, "between 1e-30 and 1e+30 (1 = off"),
        ("repetition_penalty", 1e-300, "between 1e-30 and 1e+30 (1 = off"),
        ("top_p", 1e-46, "top_p must be at least 1.1754944e-38"),
        ("top_p", 1e-300, "top_p must be at least 1.1754944e-38"),
        ("logit_bias", {"cat": 1}, "'logit_bias' keys must be token ids written as strings"),
        ("logit_bias", {"5": 101}, "between -100 and 100, got 101"),
        ("logit_bias", [1], "'logit_bias' must be an object of token id strings"),
        ("response_format", {"type": "xml"}, "'response_format' must be {'type': 'text'}"),
        ("response_format", {"type": "json_object", "schema": {}}, "holds no 'schema'"),
        ("response_format", {"type": "json_schema"}, "'json_schema' must be an object"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
            "json_schema.name must be 1 to 64 letters",
        ),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "a", "schema": []}},
            "json_schema.schema must be a JSON Schema object",
        ),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}},
            "json_schema.strict must be true or false",
        ),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "a", "shema": {}}},
            "unknown field(s) 'shema'",
        ),
    ],
)
def test_bad_values_say_what_to_fix(field, value, says):
    err = record({"messages": USER, field: value})
    assert isinstance(err, LineError)
    assert err.code == "invalid_parameter", err
    assert says in err.message
    assert err.message.startswith("line 1: ")


def test_best_of_is_still_refused_with_a_pointer_to_n():
    err = record({"prompt": "a", "best_of": 2}, url="/v1/completions")
    assert err.code == "unsupported_parameter" and "use 'n'" in err.message


def test_shard_payload_round_trips_the_new_params():
    params = SamplingParams(
        n=2,
        logit_bias={3: 1.5},
        repetition_penalty=1.1,
        structured_outputs=StructuredOutputs(json_schema=SCHEMA),
    )
    shard = ShardRequest(0, 1, "x", "/v1/chat/completions", [1, 2], {}, None, None, None)
    shard = dataclasses.replace(shard, params=json.loads(json.dumps(dataclasses.asdict(params))))
    assert shard.sampling_params() == params


# -- through kvbatch run ------------------------------------------------------------------------


def run(tmp_path: Path, llm, lines: list[dict]) -> tuple[dict, dict]:  # noqa: F811
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(model=llm.engine.config.model, input=str(path), model_name=MODEL_NAME)
    record = run_job(opts, llm=llm)
    out = {}
    for raw in (tmp_path / "in.output.jsonl").read_text().splitlines():
        line = json.loads(raw)
        out[line["custom_id"]] = line
    errors = {}
    errors_file = tmp_path / "in.output.errors.jsonl"
    if errors_file.exists():
        for raw in errors_file.read_text().splitlines():
            line = json.loads(raw)
            errors[line["custom_id"]] = line
    assert record.total == len(lines)
    return out, errors


def test_n_choices_logprobs_and_usage(tmp_path: Path, llm):  # noqa: F811
    lines = [
        chat("one", "Tell me a story", temperature=1.0, seed=7),
        chat(
            "three", "Tell me a story", temperature=1.0, seed=7, n=3, logprobs=True, top_logprobs=2
        ),
        completion("c2", "Once upon", temperature=0.8, seed=1, n=2, logprobs=1),
    ]
    out, errors = run(tmp_path, llm, lines)
    assert not errors
    one = ChatCompletion.model_validate(out["one"]["response"]["body"])
    three = ChatCompletion.model_validate(out["three"]["response"]["body"])
    assert [c.index for c in three.choices] == [0, 1, 2]
    # choice 0 samples with the request's own seed: what the n=1 line returns
    assert three.choices[0].message.content == one.choices[0].message.content
    assert len({c.message.content for c in three.choices}) > 1
    per_choice = [len(c.logprobs.content) for c in three.choices]
    assert all(len(t.top_logprobs) == 2 for c in three.choices for t in c.logprobs.content)
    assert three.usage.completion_tokens == sum(per_choice)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + sum(per_choice)
    c2 = Completion.model_validate(out["c2"]["response"]["body"])
    assert [c.index for c in c2.choices] == [0, 1]
    assert c2.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in c2.choices)


def test_logit_bias_and_penalties_change_the_answer(tmp_path: Path, llm):  # noqa: F811
    forced = 1000
    lines = [
        completion("plain", "The cat sat", max_tokens=8),
        completion("forced", "The cat sat", max_tokens=8, logit_bias={str(forced): 100}),
        completion("out-of-vocab", "The cat sat", logit_bias={"99999999": 1}),
        completion("penalised", "The cat sat", max_tokens=8, repetition_penalty=5.0),
    ]
    out, errors = run(tmp_path, llm, lines)
    tokenizer = llm.engine.tokenizer
    assert out["forced"]["response"]["body"]["choices"][0]["text"] == tokenizer.decode([forced] * 8)
    plain = out["plain"]["response"]["body"]["choices"][0]["text"]
    assert out["penalised"]["response"]["body"]["choices"][0]["text"] != plain
    bad = errors["out-of-vocab"]["error"]
    assert "logit_bias names token id 99999999" in bad["message"]


def test_structured_lines_parse_beside_free_ones(tmp_path: Path, llm):  # noqa: F811
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
    }
    lines = [
        chat("schema", "Describe a thing", max_tokens=120, response_format=schema_format),
        chat("object", "Describe a thing", max_tokens=120, response_format={"type": "json_object"}),
        chat("free", "Describe a thing"),
        chat(
            "uncompilable",
            "x",
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "bad",
                    "schema": {"$ref": "#/$defs/missing"},
                    "strict": False,  # strict mode refuses it earlier, when the line is read
                },
            },
        ),
        chat(
            "dangling",
            "x",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"$ref": "#/$defs/missing"}},
            },
        ),
    ]
    out, errors = run(tmp_path, llm, lines)
    answer = json.loads(out["schema"]["response"]["body"]["choices"][0]["message"]["content"])
    jsonschema.validate(answer, SCHEMA)
    # a random model may write one endless key: the constraint still holds to the cut
    [choice] = out["object"]["response"]["body"]["choices"]
    assert choice["message"]["content"].startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert out["free"]["error"] is None
    message = errors["uncompilable"]["error"]["message"]
    assert "cannot be compiled" in message and "missing" in message
    # xgrammar's log prefix (a clock time, a C++ path) once made each run's error file differ
    assert "\n" not in message and not re.search(r"\d\d:\d\d:\d\d|\.cc:\d", message), message
    dangling = errors["dangling"]["error"]
    assert dangling["code"] == "unsupported_parameter"
    assert "keyword '$ref'" in dangling["message"] and "'#/$defs/missing'" in dangling["message"]


@pytest.mark.parametrize(
    ("body", "code", "says"),
    [
        ({"input": []}, "invalid_parameter", "'input': input is empty"),
        ({"input": [1, "a"]}, "invalid_parameter", "not a mix of these"),
        ({"input": [[1], []]}, "invalid_parameter", "input 1 is empty"),
        (
            {"input": "x", "dimensions": 0},
            "invalid_parameter",
            "'dimensions' must be an integer >= 1",
        ),
        ({"input": "x", "encoding_format": "int8"}, "invalid_parameter", '"float" or "base64"'),
        ({"input": "x", "temperature": 0}, "unknown_parameter", "'temperature'"),
        ({"dimensions": 8}, "missing_prompt", "needs 'input'"),
    ],
)
def test_embedding_bodies_say_what_to_fix(body, code, says):
    err = record(body, url="/v1/embeddings")
    assert isinstance(err, LineError)
    assert err.code == code, err
    assert says in err.message


def test_embedding_inputs_keep_their_shapes():
    for given, want in [
        ("a b", ["a b"]),
        (["a", "b"], ["a", "b"]),
        ([3, 4], [[3, 4]]),
        ([[3], [4, 5]], [[3], [4, 5]]),
    ]:
        req = record({"input": given, "encoding_format": "base64"}, url="/v1/embeddings")
        assert isinstance(req, JobRequest) and req.is_embedding
        assert (req.inputs, req.num_inputs, req.encoding_format) == (want, len(want), "base64")


# Floats near float32's limits (the sampler's dtype), for every float field of a body.
NEAR_FLOAT32_LIMITS = st.one_of(
    st.sampled_from([1e-46, 1e-300, 5e-324, 1.4e-45, 1.1754943508222875e-38, 1e-38, 1e-30, 3.5e38]),
    st.floats(min_value=0, max_value=1e-37, allow_subnormal=True),
    st.floats(min_value=-2, max_value=2),
)
FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias",
)  # fmt: skip


@settings(max_examples=200, deadline=None, database=None)
@hypothesis_given(field=st.sampled_from(FLOAT_FIELDS), value=NEAR_FLOAT32_LIMITS)
def test_sampling_floats_near_float32_limits(field: str, value: float) -> None:
    """Each float is refused naming its field, or holds its meaning in float32: no top_p or
    repetition penalty that rounds to 0, nothing that overflows."""
    body = {"messages": USER, field: {"5": value} if field == "logit_bias" else value}
    out = record(body)
    if isinstance(out, LineError):
        assert field in out.message, out.message
        return
    p = out.params
    assert p.top_p == 1.0 or np.float32(p.top_p) > 0  # top_p 0 is greedy: top_k 1, top_p 1
    rp = np.float32(p.repetition_penalty)
    assert rp > 0 and np.isfinite(np.float32(100) / rp) and np.isfinite(np.float32(-100) * rp)
    assert np.isfinite(np.float32(p.temperature))

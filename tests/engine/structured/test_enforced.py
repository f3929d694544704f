"""Strict structured outputs: every JSON-schema keyword of draft 2020-12 is either enforced by
the grammar (every answer a walk through it can write validates with jsonschema) or refused
with a message naming it."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema.validators import Draft202012Validator
from transformers import AutoTokenizer

from kvbatch.engine.structured.enforced import ENFORCED_FORMATS, unenforced
from kvbatch.engine.structured.grammar import GrammarCompiler
from kvbatch.engine.structured.params import StructuredOutputs
from kvbatch.jobs.openai_format.answer_schema import AnswerChecker, schema_problem
from tests.engine.structured.schema_strategies import (
    KEYWORDS_2020_12,
    json_schemas,
    keywords_in,
    random_answer,
)

VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])


def test_the_strategy_knows_every_keyword_of_the_draft() -> None:
    """jsonschema's own draft 2020-12 validator and meta-schema agree with the list."""
    meta = Draft202012Validator.META_SCHEMA
    vocabularies = {v.rsplit("/", 1)[-1] for v in meta["$vocabulary"]}
    assert vocabularies == {
        "core", "applicator", "unevaluated", "validation", "meta-data", "format-annotation",
        "content",
    }  # fmt: skip
    assert set(Draft202012Validator.VALIDATORS) <= KEYWORDS_2020_12


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"const": 1}, "minContains": 1}, "contains"),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
                "dependentRequired": {"a": ["b"]},
            },
            "dependentRequired",
        ),
        ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "not"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
        ({"type": "string", "format": "email", "maxLength": 8}, "maxLength"),
        ({"type": "string", "format": "date-time"}, "format"),
        ({"$ref": "http://example.com/s.json"}, "$ref"),
        ({"$ref": "other.json"}, "$ref"),
        ({"$ref": "file:///etc/passwd"}, "$ref"),
        ({"minimum": 3}, "minimum"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"type": "object", "properties": {}, "required": ["a"]}, "required"),
        ({"type": "object", "anyOf": [{"type": "string"}]}, "type"),
        ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}, "oneOf"),
        ({"enum": ["a", 1], "type": "string"}, "enum"),
    ],
)
def test_unenforced_keywords_are_named(schema: dict, keyword: str) -> None:
    found = unenforced(schema)
    assert found is not None and found.keyword == keyword, found
    assert repr(keyword) in str(found)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
         "required": ["a"], "additionalProperties": False},
        {"$defs": {"n": {"type": ["integer", "null"], "minimum": 0}},
         "type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2, "uniqueItems": False},
        {"anyOf": [{"type": "string", "format": "email"}, {"const": 3, "title": "three"}]},
        {"oneOf": [{"type": "string"}, {"type": "boolean"}], "description": "d"},
        {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 30},
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "null",
         "x-vendor": 1},
    ],
)  # fmt: skip
def test_enforced_schemas_pass(schema: dict) -> None:
    assert unenforced(schema) is None


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(schema=json_schemas(), seed=st.integers(0, 2**32 - 1))
def test_every_keyword_is_enforced_or_refused(compiler, tokenizer, schema, seed) -> None:
    if schema_problem(schema) is not None:
        return  # not a valid schema: the line is refused before strictness is asked
    found = unenforced(schema)
    if found is not None:
        assert found.keyword in keywords_in(schema), found
        return
    assert not (keywords_in(schema) & {"not", "if", "contains", "dependentRequired"})
    spec = StructuredOutputs(json_schema=schema)
    try:
        compiler.compile(spec)
    except ValueError:
        return  # refused when the request is added: an error record, not an answer
    rng = random.Random(seed)
    checker = AnswerChecker()
    for _ in range(4):
        tokens = random_answer(compiler.matcher(spec), VOCAB, tokenizer.eos_token_id, rng, 60)
        if tokens is None:
            continue  # cut short: finish_reason "length"
        text = tokenizer.decode(tokens)
        assert checker.violation(spec, text) is None, (json.dumps(schema), text)


@pytest.mark.parametrize("fmt", ENFORCED_FORMATS)
def test_enforced_formats_validate(compiler, tokenizer, fmt: str) -> None:
    spec = StructuredOutputs(json_schema={"type": "string", "format": fmt})
    rng, checker, done = random.Random(0), AnswerChecker(), 0
    for _ in range(40):
        tokens = random_answer(compiler.matcher(spec), VOCAB, tokenizer.eos_token_id, rng, 80)
        if tokens is not None:
            done += 1
            text = tokenizer.decode(tokens)
            assert checker.violation(spec, text) is None, text
    assert done

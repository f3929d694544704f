"""OpenAI's `response_format` of a chat body, read into the engine's `StructuredOutputs`.

Three shapes, as OpenAI's Chat Completions API takes them::

    {"type": "text"}                                  no constraint
    {"type": "json_object"}                           any JSON object
    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...},
                                            "description": "...", "strict": true}}

kvbatch always constrains decoding to the schema. With `strict` true or left out, a schema
keyword the grammar cannot enforce (kvbatch.engine.structured.enforced) makes the line an
`unsupported_parameter` error that names it, as OpenAI's strict mode refuses what it cannot
guarantee; `strict: false` runs the line with those keywords unenforced. Either way the
answer is validated against the schema before it is written
(kvbatch.jobs.openai_format.answer_schema). A json_schema without `schema` asks for any JSON
object, as json_object does. Whether the schema compiles is checked by the engine when the
request is added (a per-line error there).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic_core import PydanticCustomError

from kvbatch.engine import StructuredOutputs, unenforced
from kvbatch.jobs.openai_format.answer_schema import schema_problem
from kvbatch.jobs.openai_format.shown import shown

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
_TYPES = ("text", "json_object", "json_schema")
_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
SHAPES = (
    "{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': "
    "{'name': ..., 'schema': {...}, 'strict': true}}"
)


PARAMETER_RULE = "parameter_rule"
"""The pydantic error type of a field check whose message is whole: it names the field and
says what to fix (reported with code invalid_parameter)."""


UNENFORCED = "unsupported_parameter"
"""The pydantic error type of a strict schema the grammar cannot enforce (reported with code
unsupported_parameter)."""


def _invalid(why: str) -> PydanticCustomError:
    return PydanticCustomError(PARAMETER_RULE, "'response_format' {why}", {"why": why})


def read_response_format(value: Any) -> StructuredOutputs | None:
    """The constraint `value` (a body's response_format) asks for; None for text or null.
    Raises PydanticCustomError (PARAMETER_RULE) that says what to fix."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in _TYPES:
        raise _invalid(f"must be {SHAPES}, got {shown(value)}")
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(value) - allowed)
    if extra:
        raise _invalid(f"of type {kind!r} holds no {', '.join(map(repr, extra))}: remove it")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    return _json_schema(value.get("json_schema"))


def _json_schema(spec: Any) -> StructuredOutputs:
    if not isinstance(spec, dict):
        raise _invalid(
            "'json_schema' must be an object {'name': ..., 'schema': {...}, 'strict': ...}, "
            f"got {shown(spec)}"
        )
    extra = sorted(set(spec) - _SCHEMA_KEYS)
    if extra:
        raise _invalid(
            f"json_schema holds unknown field(s) {', '.join(map(repr, extra))}: it takes "
            "name, description, schema and strict"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _invalid(
            "json_schema.name must be 1 to 64 letters, digits, '_' or '-', got " + shown(name)
        )
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise _invalid(
            f"json_schema.description must be a string, got {shown(spec['description'])}"
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _invalid(f"json_schema.strict must be true or false, got {shown(spec['strict'])}")
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutputs(json_object=True)
    if not isinstance(schema, dict):
        raise _invalid(f"json_schema.schema must be a JSON Schema object, got {shown(schema)}")
    problem = schema_problem(schema)
    if problem is not None:
        raise _invalid(f"json_schema.schema is not a valid JSON Schema ({problem}): fix it")
    if spec.get("strict") is not False:
        refused = strictness_refusal(schema, "json_schema.schema", "json_schema.strict")
        if refused is not None:
            raise refused
    return StructuredOutputs(json_schema=schema)


def strictness_refusal(schema: dict, what: str, flag: str) -> PydanticCustomError | None:
    """The error of a strict `schema` (named `what` in the message) with a keyword the grammar
    cannot enforce, or None; `flag` is the field that opts out."""
    found = unenforced(schema)
    if found is None:
        return None
    return PydanticCustomError(
        UNENFORCED,
        "{what}: {found}. Strict mode refuses what decoding cannot guarantee (supported keywords: "
        "docs/STRUCTURED_OUTPUTS.md); {flag}: false runs it anyway, with the answer checked "
        "against the schema afterwards",
        {"what": what, "found": str(found), "flag": flag},
    )

"""The schema checks of a constrained answer: the schema itself when a line is read, and each
completed answer before it is written.

The grammar enforces a subset of JSON Schema (kvbatch.engine.structured.enforced); a line
that opts out of strictness (`strict: false`) runs with the rest unenforced. Either way a
completed answer (finish_reason "stop") is validated here with jsonschema, formats included,
and one that breaks its schema makes the line an error record (code `invalid_output`),
never a success. An answer cut by max_tokens is incomplete by nature: it is written with
finish_reason "length", as OpenAI writes it.

References are resolved inside the schema only: jsonschema would otherwise fetch an
`http://` `$ref` (or read a `file://` one) while checking an answer.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for
from referencing import Registry
from referencing.exceptions import NoSuchResource

from kvbatch.engine import StructuredOutputs

_MAX_CACHED = 256


def _no_retrieval(uri: str):
    raise NoSuchResource(ref=uri)


_LOCAL_ONLY = Registry(retrieve=_no_retrieval)


def schema_problem(schema: dict) -> str | None:
    """Why `schema` is not a valid JSON Schema (draft 2020-12 unless its $schema names
    another), or None."""
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        return f"{e.message[:200]} at schema{path}"
    return None


class AnswerChecker:
    """Validates answers against their StructuredOutputs, one validator per distinct schema
    (the last `_MAX_CACHED` kept)."""

    def __init__(self) -> None:
        self._validators: OrderedDict[str, Any] = OrderedDict()

    def violation(self, spec: StructuredOutputs, text: str) -> str | None:
        """Why `text`, a completed answer, does not follow `spec`, or None when it does."""
        try:
            value = json.loads(text)
        except ValueError as e:
            return f"it is not valid JSON ({e})"
        if spec.json_object:
            return None if isinstance(value, dict) else "it is not a JSON object"
        try:
            error = next(iter(self._validator(spec).iter_errors(value)), None)
        except Exception as e:  # an unresolvable $ref, a regex Python cannot compile, ...
            return f"the schema cannot check it ({type(e).__name__}: {str(e)[:200]})"
        if error is None:
            return None
        path = "".join(f"[{p!r}]" for p in error.absolute_path)
        return f"{error.message[:200]} at answer{path} (keyword {error.validator!r})"

    def _validator(self, spec: StructuredOutputs):
        found = self._validators.get(spec.key)
        if found is None:
            schema = json.loads(spec.json_schema)
            cls = validator_for(schema, default=Draft202012Validator)
            found = cls(schema, registry=_LOCAL_ONLY, format_checker=cls.FORMAT_CHECKER)
            self._validators[spec.key] = found
            if len(self._validators) > _MAX_CACHED:
                self._validators.popitem(last=False)
        else:
            self._validators.move_to_end(spec.key)
        return found


ANSWERS = AnswerChecker()
"""The process's checker: a job's lines share a few schemas, so they share validators."""

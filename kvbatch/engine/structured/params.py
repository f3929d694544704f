"""What a request asks its output to follow: a JSON schema, or any JSON object.

Pure data, no grammar library: SamplingParams holds one, and the grammar side
(kvbatch.engine.structured.grammar) compiles it once per distinct `key`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputs:
    """A request's output constraint (OpenAI's `response_format`).

    `json_schema`: a JSON schema as a dict or a JSON string (`json_schema` response format).
    `json_object`: any JSON object (`json_object` response format). Exactly one is given.
    After construction `json_schema` is the schema's JSON text (compact, in the given key
    order: properties are generated in that order), so requests with the same schema share one
    compiled grammar.
    """

    json_schema: dict | str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        if (self.json_schema is None) == (not self.json_object):
            raise ValueError("give exactly one of json_schema (a schema) or json_object=True")
        if self.json_schema is None:
            return
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(
                f"json_schema must be a JSON object (dict), got {type(schema).__name__}"
            )
        object.__setattr__(self, "json_schema", json.dumps(schema, separators=(",", ":")))

    @property
    def key(self) -> str:
        """What identifies the compiled grammar: equal keys compile to the same grammar."""
        return "json_object" if self.json_object else f"schema:{self.json_schema}"

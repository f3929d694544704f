"""Which JSON-schema keywords the grammar enforces, and the first one in a schema it cannot.

xgrammar turns a schema into a grammar by reading one keyword per schema object in a fixed
order ($ref, const, enum, anyOf, oneOf, allOf, then `type` and that type's keywords) and
skips, with at most a log line, what it cannot express: `uniqueItems`, `contains`, `not`,
`if`/`then`/`else`, `dependentRequired`, a `$ref` outside the document, a string `format`
beside `maxLength`, ... A grammar that skips a keyword lets through answers that break it.

OpenAI's strict mode refuses a schema it cannot guarantee; so does kvbatch. `unenforced`
walks a schema and names the first keyword outside the subset below, with where it is and
what to do. The subset (draft 2020-12; docs/STRUCTURED_OUTPUTS.md lists it for users):

- anywhere: annotations (title, description, default, examples, ...), `$defs` /
  `definitions`, `$schema` naming draft 2020-12, and keywords JSON Schema does not define
  (2020-12 treats those as annotations);
- `$ref` to "#" or "#/..." inside the schema; `anyOf`; `oneOf` whose branches have distinct
  types; `allOf` of one schema: each with annotations only beside it;
- `const` and `enum`, with at most a `type` that every value has;
- `type` (a name or a list), and each type's keywords: string `minLength`/`maxLength`, or
  `pattern`, or `format` (email, ipv6, uuid); integer `minimum`, `maximum`,
  `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf` (a whole number up to 1024, with both
  bounds at most 10000 apart, or none); number: the same bounds; array `items`,
  `prefixItems`, `unevaluatedItems`, `minItems`, `maxItems`, `uniqueItems: false`; object
  `properties`, `required` (of declared properties), `additionalProperties`,
  `unevaluatedProperties`;
- without `type`, object keywords make an object and array keywords an array; other
  type-specific keywords need the `type` they apply to.

Every answer is also validated against its schema after decoding
(kvbatch.jobs.openai_format.answer_schema), so a gap in this list shows up as an error
record, never as a wrong answer reported as a success.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
        "$schema",
        "$defs",
        "definitions",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
    }
)
ENFORCED_FORMATS = ("email", "ipv6", "uuid")
MAX_INTEGER_MULTIPLE_OF = 1024  # xgrammar's limits: past them it drops multipleOf
MAX_MULTIPLE_OF_RANGE = 10000

_REFUSED = {
    "not": "the grammar cannot exclude a schema",
    "if": "conditionals are not enforced",
    "then": "conditionals are not enforced",
    "else": "conditionals are not enforced",
    "dependentRequired": "dependencies between properties are not enforced",
    "dependentSchemas": "dependencies between properties are not enforced",
    "dependencies": "dependencies between properties are not enforced",
    "contains": "the grammar cannot require an item to match",
    "minContains": "the grammar cannot count matching items",
    "maxContains": "the grammar cannot count matching items",
    "patternProperties": "property names by pattern are not enforced",
    "propertyNames": "property-name schemas are not enforced",
    "minProperties": "property counts are not enforced",
    "maxProperties": "property counts are not enforced",
    "$id": "schemas that set their own base URI are not supported",
    "$anchor": "anchors are not supported: use '$ref': '#/$defs/...'",
    "$dynamicRef": "dynamic references are not supported",
    "$dynamicAnchor": "dynamic references are not supported",
    "$recursiveRef": "recursive references are not supported: use '$ref': '#'",
    "$recursiveAnchor": "recursive references are not supported: use '$ref': '#'",
    "$vocabulary": "vocabularies are not supported",
    "additionalItems": "it is a draft-07 keyword: use 'items' with 'prefixItems'",
}
_BY_TYPE = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset(
        {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
    ),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "array": frozenset(
        {"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems"}
    ),
    "object": frozenset(
        {"properties", "required", "additionalProperties", "unevaluatedProperties"}
    ),
    "boolean": frozenset(),
    "null": frozenset(),
}
_TYPE_KEYWORDS = frozenset().union(*_BY_TYPE.values()) | {"multipleOf"}
_OBJECT_HINTS = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_HINTS = ("items", "prefixItems", "unevaluatedItems")
_JSON_TYPES = {
    "string": str,
    "boolean": bool,
    "null": type(None),
    "object": dict,
    "array": list,
}


@dataclass(frozen=True)
class Unenforced:
    """A keyword of a schema the grammar cannot enforce: what, where (a JSON pointer into the
    schema, "#" for its root) and why, with what to do."""

    keyword: str
    where: str
    why: str

    def __str__(self) -> str:
        return (
            f"keyword {self.keyword!r} at {self.where} is not enforced by the grammar: {self.why}"
        )


def unenforced(schema: Any) -> Unenforced | None:
    """The first keyword of `schema` (a JSON schema, already valid) that decoding would not
    enforce, or None when the grammar enforces all of it."""
    return _Walk(schema).check(schema, "#")


class _Refusal(Exception):
    def __init__(self, found: Unenforced) -> None:
        self.found = found


class _Walk:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.seen: set[int] = set()

    def check(self, schema: Any, where: str) -> Unenforced | None:
        try:
            self.schema(schema, where)
        except _Refusal as refusal:
            return refusal.found
        return None

    def refuse(self, keyword: str, where: str, why: str) -> None:
        raise _Refusal(Unenforced(keyword, where, why))

    def schema(self, schema: Any, where: str) -> None:
        if not isinstance(schema, dict) or id(schema) in self.seen:
            return  # true/false: the grammar's any/none
        self.seen.add(id(schema))
        for name in ("$defs", "definitions"):
            defs = schema.get(name)
            for key, sub in defs.items() if isinstance(defs, dict) else ():
                self.schema(sub, f"{where}/{name}/{key}")
        if "$schema" in schema and str(schema["$schema"]).rstrip("#") != DRAFT_2020_12:
            self.refuse(
                "$schema",
                where,
                f"the grammar reads draft 2020-12 ({DRAFT_2020_12}): drop $schema or name it",
            )
        for keyword, why in _REFUSED.items():
            if keyword in schema:
                self.refuse(keyword, where, why)
        if schema.get("uniqueItems", False) is not False:
            self.refuse("uniqueItems", where, "the grammar cannot keep items distinct")
        for keyword in ("$ref", "const", "enum", "anyOf", "oneOf", "allOf"):
            if keyword in schema:
                return getattr(self, "_" + keyword.lstrip("$").replace("Of", "_of"))(schema, where)
        self.typed(schema, where)

    def only_annotations_beside(self, keyword: str, schema: dict, where: str, allowed=()) -> None:
        for other in schema:
            if other != keyword and other not in ANNOTATIONS and other not in allowed:
                if (
                    other in _TYPE_KEYWORDS
                    or other in ("type", "$ref", "const", "enum")
                    or (other.endswith("Of"))
                ):
                    self.refuse(
                        other,
                        where,
                        f"beside {keyword!r} the grammar follows {keyword!r} alone: move it into "
                        f"the schema {keyword!r} names, or remove it",
                    )

    def _ref(self, schema: dict, where: str) -> None:
        self.only_annotations_beside("$ref", schema, where)
        ref = schema["$ref"]
        target = self.resolve(ref) if isinstance(ref, str) else None
        if target is None:
            self.refuse(
                "$ref",
                where,
                f"{ref!r} is not a definition inside this schema: the grammar reads only '#' and "
                "'#/...' pointers into the schema itself (put the definition under '$defs')",
            )
        self.schema(target, ref)

    def resolve(self, ref: str) -> Any | None:
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            return None
        node = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if isinstance(node, (dict, bool)) else None

    def _const(self, schema: dict, where: str) -> None:
        self.values("const", [schema["const"]], schema, where)

    def _enum(self, schema: dict, where: str) -> None:
        self.values("enum", schema["enum"], schema, where)

    def values(self, keyword: str, values: list, schema: dict, where: str) -> None:
        """const and enum: the grammar writes one of the values and reads no other keyword but
        `type`, which every value must then have."""
        if keyword == "const" and "enum" in schema:
            self.refuse("enum", where, "beside 'const' the grammar follows 'const' alone: keep one")
        self.only_annotations_beside(keyword, schema, where, allowed=("type",))
        types = schema.get("type")
        if types is None:
            return
        types = [types] if isinstance(types, str) else types
        for value in values:
            if not any(_has_type(value, t) for t in types):
                self.refuse(
                    keyword,
                    where,
                    f"the value {value!r} is not of type {schema['type']!r}: fix one of them",
                )

    def _any_of(self, schema: dict, where: str) -> None:
        self.only_annotations_beside("anyOf", schema, where)
        for i, branch in enumerate(schema["anyOf"]):
            self.schema(branch, f"{where}/anyOf/{i}")

    def _one_of(self, schema: dict, where: str) -> None:
        self.only_annotations_beside("oneOf", schema, where)
        kinds = [b.get("type") if isinstance(b, dict) else None for b in schema["oneOf"]]
        names = [k.replace("integer", "number") for k in kinds if isinstance(k, str)]
        if len(names) != len(kinds) or len(set(names)) != len(names):
            self.refuse(
                "oneOf",
                where,
                "the grammar cannot keep answers from matching two branches unless each branch "
                "has its own 'type': use 'anyOf' if overlapping branches are fine",
            )
        for i, branch in enumerate(schema["oneOf"]):
            self.schema(branch, f"{where}/oneOf/{i}")

    def _all_of(self, schema: dict, where: str) -> None:
        self.only_annotations_beside("allOf", schema, where)
        if len(schema["allOf"]) != 1:
            self.refuse(
                "allOf",
                where,
                "the grammar cannot intersect schemas: merge them into one schema",
            )
        self.schema(schema["allOf"][0], f"{where}/allOf/0")

    def typed(self, schema: dict, where: str) -> None:
        types = schema.get("type")
        if types is None:
            if any(k in schema for k in _OBJECT_HINTS):
                types = ["object"]
            elif any(k in schema for k in _ARRAY_HINTS):
                types = ["array"]
            else:
                types = []
        elif isinstance(types, str):
            types = [types]
        applied = frozenset().union(*(_BY_TYPE.get(t, frozenset()) for t in types))
        for keyword in schema:
            if keyword in _TYPE_KEYWORDS and keyword not in applied and not types:
                self.refuse(
                    keyword,
                    where,
                    "without a 'type' the grammar writes any JSON value and skips it: add the "
                    "'type' it applies to",
                )
        if "string" in types:
            self.string(schema, where)
        if "integer" in types:
            self.integer(schema, where)
        if "number" in types and "multipleOf" in schema:
            self.refuse(
                "multipleOf",
                where,
                "not enforced on type 'number' (only on 'integer')",
            )
        if "array" in types:
            for i, item in enumerate(schema.get("prefixItems") or []):
                self.schema(item, f"{where}/prefixItems/{i}")
            for keyword in ("items", "unevaluatedItems"):
                self.schema(schema.get(keyword), f"{where}/{keyword}")
        if "object" in types:
            self.object(schema, where)

    def string(self, schema: dict, where: str) -> None:
        fmt = schema.get("format")
        if fmt is not None and fmt not in ENFORCED_FORMATS:
            self.refuse(
                "format",
                where,
                f"format {fmt!r} is not enforced (those that are: "
                f"{', '.join(ENFORCED_FORMATS)}): use a 'pattern'",
            )
        # The grammar reads format, else pattern, else the lengths: one of them.
        first = "format" if fmt is not None else "pattern" if "pattern" in schema else None
        if first is not None:
            for other in ("pattern", "minLength", "maxLength"):
                if other != first and other in schema:
                    self.refuse(
                        other,
                        where,
                        f"beside {first!r} the grammar enforces {first!r} alone: "
                        + (
                            "put the length into the pattern ('^.{0,8}$')"
                            if first == "pattern"
                            else "use a 'pattern' that says both"
                        ),
                    )

    def integer(self, schema: dict, where: str) -> None:
        step = schema.get("multipleOf")
        if step is None:
            return
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        whole = float(step).is_integer() and step <= MAX_INTEGER_MULTIPLE_OF
        bounded = (low is None and high is None) or (
            low is not None and high is not None and high - low <= MAX_MULTIPLE_OF_RANGE
        )
        if not (whole and bounded):
            self.refuse(
                "multipleOf",
                where,
                f"enforced only as a whole number up to {MAX_INTEGER_MULTIPLE_OF}, with no "
                f"bounds or with both at most {MAX_MULTIPLE_OF_RANGE} apart",
            )

    def object(self, schema: dict, where: str) -> None:
        properties = schema.get("properties") or {}
        for name, sub in properties.items():
            self.schema(sub, f"{where}/properties/{_pointer(name)}")
        for keyword in ("additionalProperties", "unevaluatedProperties"):
            self.schema(schema.get(keyword), f"{where}/{keyword}")
        missing = [n for n in schema.get("required") or () if n not in properties]
        if missing:
            self.refuse(
                "required",
                where,
                f"it names {missing[0]!r}, which 'properties' does not define: the grammar "
                "writes only declared properties, so define it there",
            )


def _has_type(value: Any, name: str) -> bool:
    if name in ("number", "integer"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return name == "number" or float(value).is_integer()
    kind = _JSON_TYPES.get(name)
    return (
        kind is not None
        and isinstance(value, kind)
        and not (kind is not bool and isinstance(value, bool))
    )


def _pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")

"""A hypothesis strategy of JSON schemas that uses every keyword of draft 2020-12, and a random
walk through a compiled grammar that writes the answers a model could write."""

from __future__ import annotations

import random

import numpy as np
import torch
from hypothesis import strategies as st

from kvbatch.engine.structured.grammar import GrammarMatcher

# Every keyword draft 2020-12 defines, by vocabulary (json-schema.org/draft/2020-12/meta/*).
KEYWORDS_2020_12 = frozenset(
    {
        # core
        "$schema", "$id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary",
        "$comment", "$defs",
        # applicator
        "prefixItems", "items", "contains", "additionalProperties", "properties",
        "patternProperties", "dependentSchemas", "propertyNames", "if", "then", "else",
        "allOf", "anyOf", "oneOf", "not",
        # unevaluated
        "unevaluatedItems", "unevaluatedProperties",
        # validation
        "type", "const", "enum", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "maxItems", "minItems",
        "uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties",
        "required", "dependentRequired",
        # meta-data, format, content
        "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",
        "format", "contentEncoding", "contentMediaType", "contentSchema",
    }
)  # fmt: skip

NAMES = st.sampled_from(["a", "b", "c", "d"])
SMALL = st.integers(0, 4)
PATTERNS = st.sampled_from(["^[a-c]{1,3}$", "^x[0-9]?$", "^(yes|no)$", "[0-9]+", "^a+b*$"])
FORMATS = st.sampled_from(
    ["email", "ipv4", "ipv6", "uuid", "date", "date-time", "time", "hostname", "uri", "duration"]
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(["x", "yz", ""]), st.just(1.5)
)


def _some(draw, options: dict) -> dict:
    """A random subset of `options` (keyword -> strategy), drawn."""
    return {k: draw(v) for k, v in options.items() if draw(st.integers(0, 3)) == 0}


@st.composite
def _string(draw) -> dict:
    schema = {"type": "string"}
    schema |= _some(
        draw,
        {"minLength": st.integers(0, 2), "maxLength": st.integers(2, 6), "pattern": PATTERNS,
         "format": FORMATS},
    )  # fmt: skip
    if "format" not in schema and "pattern" not in schema:
        schema.setdefault("maxLength", draw(st.integers(1, 6)))  # a random walk ends
    return schema


@st.composite
def _integer(draw) -> dict:
    low = draw(st.integers(-50, 50))
    options = {
        "minimum": st.just(low),
        "maximum": st.integers(low, low + 200),
        "exclusiveMinimum": st.integers(-60, 60),
        "exclusiveMaximum": st.integers(low + 2, low + 300),
        "multipleOf": st.sampled_from([1, 2, 3, 7, 2.5, 2000]),
    }
    return {"type": "integer"} | _some(draw, options)


@st.composite
def _number(draw) -> dict:
    options = {
        "minimum": st.sampled_from([-1.5, 0, 2]),
        "maximum": st.sampled_from([3, 10.25, 100]),
        "exclusiveMinimum": st.sampled_from([-2, 0.5]),
        "exclusiveMaximum": st.sampled_from([4.5, 1000]),
        "multipleOf": st.sampled_from([0.5, 3]),
    }
    return {"type": "number"} | _some(draw, options)


LEAVES = st.one_of(
    _string(),
    _integer(),
    _number(),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, True, {}]),
    st.builds(lambda v: {"const": v}, SCALARS),
    st.lists(SCALARS, min_size=1, max_size=3, unique_by=repr).map(lambda v: {"enum": v}),
    st.builds(lambda v: {"const": v, "type": "string"}, SCALARS),
    st.builds(lambda t: {"type": t}, st.lists(st.sampled_from(["string", "null", "integer"]),
                                              min_size=1, max_size=2, unique=True)),
)  # fmt: skip


def _object(inner):
    @st.composite
    def build(draw) -> dict:
        props = draw(st.dictionaries(NAMES, inner, max_size=3))
        schema: dict = {"type": draw(st.sampled_from(["object", None]))}
        schema["properties"] = props
        schema |= _some(
            draw,
            {
                "required": st.lists(NAMES, max_size=3, unique=True),
                "additionalProperties": st.one_of(st.booleans(), inner),
                "unevaluatedProperties": st.one_of(st.booleans(), inner),
                "patternProperties": st.dictionaries(PATTERNS, inner, max_size=1),
                "propertyNames": st.just({"maxLength": 1}),
                "minProperties": SMALL,
                "maxProperties": SMALL,
                "dependentRequired": st.dictionaries(
                    NAMES, st.lists(NAMES, max_size=2), max_size=1
                ),
                "dependentSchemas": st.dictionaries(NAMES, inner, max_size=1),
            },
        )
        if schema["type"] is None:
            del schema["type"]
        if "additionalProperties" not in schema and draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    return build()


def _array(inner):
    @st.composite
    def build(draw) -> dict:
        schema: dict = {"type": "array", "maxItems": draw(st.integers(0, 3))}
        schema |= _some(
            draw,
            {
                "items": st.one_of(st.booleans(), inner),
                "prefixItems": st.lists(inner, max_size=2),
                "unevaluatedItems": st.one_of(st.booleans(), inner),
                "minItems": st.integers(0, 2),
                "uniqueItems": st.booleans(),
                "contains": inner,
                "minContains": SMALL,
                "maxContains": SMALL,
            },
        )
        return schema

    return build()


def _combined(inner):
    branches = st.lists(inner, min_size=1, max_size=3)
    return st.one_of(
        branches.map(lambda b: {"anyOf": b}),
        branches.map(lambda b: {"oneOf": b}),
        branches.map(lambda b: {"allOf": b}),
        inner.map(lambda s: {"not": s}),
        st.tuples(inner, inner, inner).map(lambda t: {"if": t[0], "then": t[1], "else": t[2]}),
        st.tuples(inner, st.sampled_from(["title", "description", "$comment"])).map(
            lambda t: t[0] | {t[1]: "x"} if isinstance(t[0], dict) else t[0]
        ),
    )


SUBSCHEMAS = st.recursive(
    LEAVES, lambda inner: st.one_of(_object(inner), _array(inner), _combined(inner)), max_leaves=6
)
EXTRAS = {
    "$schema": st.sampled_from(
        ["https://json-schema.org/draft/2020-12/schema", "http://json-schema.org/draft-07/schema#"]
    ),
    "$id": st.just("https://example.com/s.json"),
    "$anchor": st.just("top"),
    "$dynamicAnchor": st.just("node"),
    "$vocabulary": st.just({"https://json-schema.org/draft/2020-12/vocab/core": True}),
    "deprecated": st.booleans(),
    "readOnly": st.booleans(),
    "writeOnly": st.booleans(),
    "examples": st.just([{}]),
    "default": SCALARS,
    "contentEncoding": st.just("base64"),
    "contentMediaType": st.just("application/json"),
    "contentSchema": st.just({"type": "object"}),
}


_REFUSED_OFTEN = {
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains",
    "minContains", "maxContains", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "$id", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary",
    "uniqueItems", "$schema",
}  # fmt: skip


def tame(schema: object) -> object:
    """`schema` without the keywords that are refused wherever they appear, so that half the
    schemas drawn reach the grammar."""
    if isinstance(schema, list):
        return [tame(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _REFUSED_OFTEN:
            continue
        if key in ("properties", "$defs", "patternProperties", "dependentSchemas"):
            out[key] = {name: tame(v) for name, v in value.items()}
        elif key == "$ref":
            out[key] = value if value in ("#", "#/$defs/d") else "#/$defs/d"
        elif key in ("enum", "const", "default", "examples", "required"):
            out[key] = value
        else:
            out[key] = tame(value)
    return out


@st.composite
def json_schemas(draw) -> dict:
    """A root schema: an object of subschemas, with $defs reached by $ref (local, dynamic,
    remote, to a file) and some of the core and annotation keywords; half of them without the
    keywords strict mode always refuses."""
    schema = draw(_wild_schemas())
    return tame(schema) if draw(st.booleans()) else schema


@st.composite
def _wild_schemas(draw) -> dict:
    definition = draw(SUBSCHEMAS)
    ref = draw(
        st.sampled_from(
            ["#/$defs/d", "#", "#/$defs/missing", "http://example.com/s.json", "other.json",
             "file:///etc/passwd", "#top"]
        )
    )  # fmt: skip
    properties = {"p": draw(SUBSCHEMAS), "r": {"$ref": ref} if ref != "#" else {"type": "null"}}
    schema: dict = {"type": "object", "properties": properties, "$defs": {"d": definition}}
    if draw(st.booleans()):
        properties["q"] = {"$dynamicRef": "#node"}
    schema |= _some(draw, EXTRAS)
    schema["required"] = draw(st.lists(st.sampled_from(["p", "r"]), unique=True))
    return schema


def keywords_in(schema: object) -> set[str]:
    """Every key of every object in `schema` (keywords and property names alike)."""
    if isinstance(schema, dict):
        return set(schema).union(*(keywords_in(v) for v in schema.values()))
    if isinstance(schema, list):
        return set().union(*(keywords_in(v) for v in schema))
    return set()


def random_answer(
    matcher: GrammarMatcher, vocab_size: int, stop: int, rng: random.Random, max_steps: int
) -> list[int] | None:
    """The tokens of one walk through `matcher`'s grammar, each drawn among those it allows
    (short tokens and the stop token favoured, so that walks end); None if the walk does not
    end within `max_steps`. A model can write exactly these answers."""
    words = torch.empty((1, -(-vocab_size // 32)), dtype=torch.int32)
    tokens: list[int] = []
    for _ in range(max_steps):
        matcher.fill_bitmask(words, 0)
        bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        if stop in allowed and rng.random() < 0.5:
            assert matcher.accept(stop)
            return tokens
        choices = [t for t in allowed.tolist() if t != stop]
        if not choices:
            return None
        short = [t for t in choices[:400] if t < 400]  # byte-level tokens: one character
        token = rng.choice(short if short and rng.random() < 0.7 else choices)
        assert matcher.accept(token)
        tokens.append(token)
    return None

"""OpenAI's function calling in a chat body (`tools`, `tool_choice`, `parallel_tool_calls`),
read as vLLM serves it, and the answer's `tool_calls`.

    tools        [{"type": "function", "function": {"name", "description", "parameters",
                                                     "strict"}}, ...]
    tool_choice  "none"      tools are shown to the template; the answer is plain text
                 "auto"      (the default with tools) the model decides; its text is read by
                             the job's tool-call parser (kvbatch.jobs.openai_format.tool_parsers)
                 "required"  decoding is constrained to a JSON array of
                             {"name": <a tool>, "parameters": <its arguments>}, one item or more
                 {"type": "function", "function": {"name": X}}
                             decoding is constrained to X's parameters schema: the whole text
                             is X's arguments

The two forced choices use the structured-outputs engine with the schemas vLLM builds for them
(vllm/entrypoints/openai/protocol.py, `_get_json_schema_from_tool`), so a batch moved from
vLLM gets the same kind of answer. Checks raise PydanticCustomError(PARAMETER_RULE) whose
message names the tool and says what to fix.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for
from pydantic_core import PydanticCustomError

from kvbatch.engine import StructuredOutputs
from kvbatch.jobs.openai_format.response_format import PARAMETER_RULE, strictness_refusal
from kvbatch.jobs.openai_format.shown import shown
from kvbatch.jobs.openai_format.tool_parsers import get_parser

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
NO_PARAMETERS = {"type": "object", "properties": {}}
"""The arguments schema of a function without `parameters` (vLLM's choice too)."""
CHOICES = "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


def _invalid(message: str) -> PydanticCustomError:
    """A whole message, no placeholders: a user's value in it is shown as written."""
    return PydanticCustomError(PARAMETER_RULE, message)


def read_tools(value: Any) -> list[dict] | None:
    """The body's `tools`, checked (None for null or []): each a function with a valid name
    and, if given, a description string and a JSON Schema object as parameters."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise _invalid(
            "'tools' must be a list of {'type': 'function', 'function': {...}}, got " + shown(value)
        )
    tools, names = [], set()
    for i, tool in enumerate(value):
        where = f"'tools[{i}]'"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _invalid(
                f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
                f"'parameters': {{...}}}}}} (kvbatch calls functions only), got {shown(tool)}"
            )
        if not isinstance(tool.get("function"), dict):
            raise _invalid(
                f"{where} needs a 'function' object {{'name': ..., 'description': ..., "
                f"'parameters': {{...}}}}, got {shown(tool.get('function'))}"
            )
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise _invalid(
                f"{where} holds 'type' and 'function' only: remove {', '.join(map(repr, extra))}"
            )
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _invalid(
                f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got "
                + shown(name)
            )
        where = f"'tools[{i}]' ({name})"
        extra = sorted(set(function) - _FUNCTION_KEYS)
        if extra:
            raise _invalid(
                f"{where}: unknown field(s) {', '.join(map(repr, extra))} in 'function': it "
                "takes name, description, parameters and strict"
            )
        if name in names:
            raise _invalid(f"{where}: two tools are named {name!r}: give each tool its own name")
        names.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise _invalid(f"{where}: 'description' must be a string")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise _invalid(f"{where}: 'strict' must be true or false")
        _check_parameters(function.get("parameters"), where)
        tools.append({"type": "function", "function": function})
    return tools


def _check_parameters(schema: Any, where: str) -> None:
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise _invalid(f"{where}: 'parameters' must be a JSON Schema object, got {shown(schema)}")
    if schema.get("type", "object") != "object":
        raise _invalid(
            f"{where}: 'parameters' must be a schema of type 'object' (the arguments are an "
            f"object), got type {shown(schema.get('type'))}"
        )
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.path)
        raise _invalid(
            f"{where}: 'parameters' is not a valid JSON Schema ({e.message[:200]} at "
            f"parameters{path}): fix the schema"
        ) from None


def read_tool_choice(value: Any) -> str | None:
    """'none', 'auto', 'required', the name of a forced function, or None (not given)."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if (
        isinstance(value, dict)
        and value.get("type") == "function"
        and set(value) == {"type", "function"}
        and isinstance(value["function"], dict)
        and set(value["function"]) == {"name"}
        and isinstance(value["function"]["name"], str)
    ):
        return "function:" + value["function"]["name"]
    raise _invalid(f"'tool_choice' must be {CHOICES}, got {shown(value)}")


def forced_name(choice: str | None) -> str | None:
    """The function a read tool_choice forces, or None."""
    return choice[len("function:") :] if choice and choice.startswith("function:") else None


@dataclass(frozen=True)
class ToolCalling:
    """How a chat answer's text becomes `tool_calls`; None on a request that asks for none.

    mode "named": the text is the arguments of `name`; "required": the text is a JSON array of
    {"name", "parameters"}; "auto": `parser` (kvbatch.jobs.openai_format.tool_parsers) reads the text.
    `parallel` false keeps one call at most (OpenAI's parallel_tool_calls)."""

    mode: str
    name: str | None = None
    parser: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("named", "required", "auto"):
            raise ValueError(f"ToolCalling mode must be named, required or auto, got {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("a named ToolCalling needs the function's name, the others none")
        if self.mode == "auto":
            get_parser(self.parser or "")  # an unknown parser fails here, not per answer


def tool_calling_for(
    tools: list[dict] | None, choice: str | None, parallel: bool | None, parser: str | None
) -> ToolCalling | None:
    """The answer reading a body asks for. Raises ValueError for "auto" without a parser."""
    if not tools:
        return None
    choice = choice or "auto"
    if choice == "none":
        return None
    parallel = parallel is not False
    name = forced_name(choice)
    if name is not None:
        return ToolCalling("named", name=name, parallel=parallel)
    if choice == "required":
        return ToolCalling("required", parallel=parallel)
    if parser is None:
        raise ValueError(
            "tool_choice 'auto' (the default when tools are given) needs the job's tool-call "
            "parser to read calls out of the text: run the job with --tool-call-parser hermes "
            "(Qwen2.5/Qwen3, Hermes models) or openai (gpt-oss), or set tool_choice to "
            "'required', a named function or 'none'"
        )
    return ToolCalling("auto", parser=parser, parallel=parallel)


def tool_constraint(
    tools: list[dict], choice: str, parallel: bool | None
) -> StructuredOutputs | None:
    """The output constraint of a forced tool_choice (named or "required"), else None. A
    function whose `strict` is not false must have parameters the grammar enforces
    (PydanticCustomError naming the keyword otherwise)."""
    functions = [t["function"] for t in tools]
    name = forced_name(choice)
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
    for function in functions:
        if function.get("strict") is not False and function.get("parameters"):
            refused = strictness_refusal(
                function["parameters"],
                f"'tools' ({function['name']}) parameters",
                "the function's 'strict'",
            )
            if refused is not None:
                raise refused
    if name is not None:
        function = functions[0]
        return StructuredOutputs(json_schema=function.get("parameters") or NO_PARAMETERS)
    if choice != "required":
        return None
    items, defs = [], {}
    for function in functions:
        parameters = copy.deepcopy(function.get("parameters") or NO_PARAMETERS)
        # vLLM lifts each tool's $defs to the array's root, where their "#/$defs/..." refs
        # now point: two tools with one name for different definitions cannot share it.
        for key, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, definition) != definition:
                raise _invalid(
                    f"'tools': two tools define '$defs.{key}' differently, and tool_choice "
                    "'required' puts every tool in one schema: rename one of them"
                )
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [function["name"]]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputs(json_schema=schema)


@dataclass(frozen=True)
class ToolAnswer:
    """A chat choice read for tool calls: its content, its calls as (name, arguments JSON
    text), and whether any call was made."""

    content: str | None
    calls: list[tuple[str, str]]


def read_answer(spec: ToolCalling, text: str) -> ToolAnswer:
    """`text` (one choice's output) read as `spec` says. Text that holds no well-formed call
    (a forced answer cut by max_tokens, say) stays content; a named answer is its function's
    arguments as written, complete or not, as vLLM returns it."""
    if spec.mode == "named":
        return ToolAnswer(None, [(spec.name, text)])
    if spec.mode == "required":
        try:
            items = json.loads(text)
            calls = [
                (item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items
            ]
        except (ValueError, TypeError, KeyError):
            return ToolAnswer(text, [])
    else:
        parsed = get_parser(spec.parser or "").parse(text)
        calls = [(c.name, c.arguments) for c in parsed.calls]
        if not calls:
            return ToolAnswer(text, [])
        text = parsed.content
    if not spec.parallel:
        calls = calls[:1]
    return ToolAnswer(None if spec.mode == "required" else text, calls)

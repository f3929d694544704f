"""Tool-call parsers: a model's own way of writing calls in its text, read into OpenAI's
`tool_calls` (what `tool_choice: "auto"` needs, as vLLM's `--tool-call-parser`).

Each model family writes calls its own way, and only the job knows which one it runs, so the
parser is chosen per job (`--tool-call-parser NAME`), never guessed from the text. A parser is
a pure function of the generated text: it never sees tokens, so a call split over tokens
reads the same as one token.

    Hermes (NousResearch Hermes 2 Pro, Qwen2.5, Qwen3 templates):
        I'll look that up.
        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

Add a parser by writing a class with `parse` and registering it in PARSERS.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ParsedCall:
    """One call the text holds: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedText:
    """What a parser read: the calls (none when the text holds no well-formed call) and the
    rest of the text, the answer's `content` (None when nothing is left)."""

    calls: list[ParsedCall]
    content: str | None


class ToolCallParser(Protocol):
    """Reads one family's tool calls out of a finished answer. Must not raise: text that is
    not a well-formed call stays content, as vLLM's parsers do.

    `markers`: the texts the parser needs to see in the answer. The engine's text skips
    special tokens, so a model whose tokenizer marks one of them special cannot be read (vLLM
    turns skipping off for such requests; kvbatch refuses the line, see jobs/openai_format/prompts.py)."""

    markers: tuple[str, ...]

    def parse(self, text: str) -> ParsedText: ...


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as vLLM's `hermes` parser.

    Like vLLM's, a last `<tool_call>` left open (the model stopped before its closing tag, e.g.
    at the end-of-turn token) is still read, and if any call is not a JSON object with a string
    "name", nothing is taken as a call: the whole text is the content. The arguments are
    re-serialised (`json.dumps`, non-ASCII kept), so the answer's `arguments` is always one
    compact JSON text however the model spaced it (arguments written as a JSON string are
    read as the JSON they hold, missing arguments as {}). Unlike vLLM, which keeps only the text
    before the first call, the content is all the text outside the tags, each piece trimmed and
    the pieces joined by newlines: text between or after calls is not lost."""

    START, END = "<tool_call>", "</tool_call>"
    markers = (START, END)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse(self, text: str) -> ParsedText:
        if self.START not in text:
            return ParsedText([], text)
        calls = []
        for match in self._CALL.finditer(text):
            call = _read_call(match.group(1) if match.group(1) is not None else match.group(2))
            if call is None:
                return ParsedText([], text)
            calls.append(call)
        pieces = (piece.strip() for piece in self._CALL.split(text)[::3])
        rest = "\n".join(piece for piece in pieces if piece)
        return ParsedText(calls, rest or None)


def _read_call(raw: str) -> ParsedCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HarmonyCallsParser:
    """gpt-oss (vLLM's `openai`): calls are harmony messages on the commentary channel to
    `functions.NAME`, which the reasoning parser reads from the tokens
    (kvbatch.engine.reasoning.harmony) before any text exists; the content holds none."""

    markers: tuple[str, ...] = ()

    def parse(self, text: str) -> ParsedText:
        return ParsedText([], text)


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "openai": HarmonyCallsParser}
"""The parsers `--tool-call-parser` names."""


def get_parser(name: str) -> ToolCallParser:
    """The parser called `name`; ValueError naming the known ones otherwise."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown tool-call parser {name!r}: kvbatch has {', '.join(sorted(PARSERS))}"
        )
    return cls()

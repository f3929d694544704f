"""Which reasoning parser a model gets: named (`reasoning_parser`, vLLM's names), or read
from its tokenizer and chat template.

    openai_gptoss  the vocabulary holds harmony's <|channel|> <|message|> <|return|> <|call|>
    deepseek_r1    the chat template writes </think> and DeepSeek's <｜Assistant｜> turn
    qwen3          the chat template writes </think> (Qwen3, QwQ, SmolLM3, ...)
    none           kvbatch's: no parser, the answer is all content

The job and the engine both choose from the tokenizer alone, so they always agree.
"""

from __future__ import annotations

from collections.abc import Callable

from kvbatch.engine.reasoning.markers import marker_token
from kvbatch.engine.reasoning.parser import ReasoningParser
from kvbatch.engine.reasoning.think import END, ThinkParser, think_token_ids

NO_REASONING_PARSER = "none"  # kvbatch's: no parser at all
HARMONY_PARSER = "openai_gptoss"  # gpt-oss: openai-harmony renders its prompts too
HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|return|>", "<|call|>")


def _harmony(tokenizer) -> ReasoningParser:
    # openai-harmony is loaded only for gpt-oss models (its vocabulary is written on first use)
    from kvbatch.engine.reasoning.harmony import HarmonyParser

    return HarmonyParser()


PARSERS: dict[str, Callable[[object], ReasoningParser]] = {
    "deepseek_r1": lambda tokenizer: ThinkParser(tokenizer, "deepseek_r1"),
    HARMONY_PARSER: _harmony,
    "qwen3": lambda tokenizer: ThinkParser(tokenizer, "qwen3"),
}
"""The parsers `reasoning_parser` names (and NO_REASONING_PARSER)."""
PARSER_CHOICES = (*sorted(PARSERS), NO_REASONING_PARSER)


def detect_reasoning_parser(tokenizer) -> str | None:
    """The parser name of a model's tokenizer (and its chat template), or None when it does
    not reason in a format kvbatch reads."""
    if tokenizer is None:
        return None
    if all(marker_token(tokenizer, marker) is not None for marker in HARMONY_MARKERS):
        return HARMONY_PARSER
    template = _template_source(tokenizer)
    if END in template and think_token_ids(tokenizer) is not None:
        return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"
    return None


def choose_reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The parser named `name` (NO_REASONING_PARSER: none), or the one detected when `name` is None.
    Raises ValueError naming the known parsers for an unknown name, or saying why the named
    parser cannot read this model's tokens."""
    if name == NO_REASONING_PARSER:
        return None
    if name is None:
        name = detect_reasoning_parser(tokenizer)
        if name is None:
            return None
    make = PARSERS.get(name)
    if make is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}: kvbatch has {', '.join(PARSER_CHOICES)}"
        )
    if tokenizer is None:
        raise ValueError(f"the reasoning parser {name!r} needs the model's tokenizer")
    return make(tokenizer)


def _template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""

"""What a reasoning parser is: the split of one answer, and the watcher that tells a grammar
when the reasoning is over."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ReasoningCall:
    """A tool call the format itself carries (harmony's commentary to `functions.NAME`):
    the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ReasoningSplit:
    """One answer split: `reasoning` (None when the model wrote none), `content` (None when
    the answer never started, e.g. max_tokens reached inside the reasoning), the tool calls
    the format carries, and how many output tokens belong to the reasoning."""

    reasoning: str | None
    content: str | None
    num_reasoning_tokens: int
    calls: list[ReasoningCall] = field(default_factory=list)


class ReasoningEnd(Protocol):
    """Watches one sequence's tokens: `ended` once the reasoning is over and the answer has
    begun (the grammar of a structured output applies from the next token on)."""

    ended: bool

    def accept(self, token_id: int) -> None:
        """Take the next output token."""


class ReasoningParser(Protocol):
    """One output format of reasoning models. Works on token ids, never on decoded text: the
    markers may be special tokens, which decoded answers leave out."""

    name: str
    stop_token_ids: tuple[int, ...]  # tokens that end an answer in this format

    def split(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
    ) -> ReasoningSplit:
        """The reasoning, the answer and the calls of `output_token_ids`, which followed
        `prompt_token_ids` (a prompt may open the reasoning itself)."""

    def reasoning_end(self, prompt_token_ids: Sequence[int]) -> ReasoningEnd:
        """A fresh watcher for an answer to `prompt_token_ids`."""

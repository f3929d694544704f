"""A grammar that starts where the reasoning ends (vLLM's structured outputs with reasoning).

A reasoning model thinks in free text before it answers; a JSON schema constrains the answer
only. Until the reasoning parser's watcher (kvbatch.engine.reasoning) sees the reasoning end
(`</think>`, or the header of harmony's `final` message) every token is allowed and the
grammar sees none; from the next token on the grammar decides, and the answer ends when it
completes.

    <think> free ... free </think> { "city" : "Paris" } <eos>
    |------- all tokens -------|   |--- grammar's mask ---|
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from kvbatch.engine.reasoning.parser import ReasoningEnd
from kvbatch.engine.structured.constraint import TokenConstraint


class GrammarAfterReasoning:
    """A TokenConstraint: all tokens while `end` says the reasoning goes on, then `grammar`."""

    def __init__(self, grammar: TokenConstraint, end: ReasoningEnd) -> None:
        self.grammar = grammar
        self.end = end

    @staticmethod
    def fill_bitmasks(constraints: Sequence[GrammarAfterReasoning], bitmask: Tensor) -> None:
        answering = [i for i, c in enumerate(constraints) if c.end.ended]
        bitmask.fill_(-1)  # every bit set: every token allowed
        if not answering:
            return
        grammars = [constraints[i].grammar for i in answering]
        if len(answering) == len(constraints):
            type(grammars[0]).fill_bitmasks(grammars, bitmask)
            return
        rows = bitmask[answering]  # a copy: filled, then written back
        type(grammars[0]).fill_bitmasks(grammars, rows)
        bitmask[answering] = rows

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        if self.end.ended:
            self.grammar.fill_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)

    def accept(self, token_id: int) -> bool:
        if self.end.ended:
            return self.grammar.accept(token_id)
        self.end.accept(token_id)  # the token that ends the reasoning is not the answer's
        return True

    def is_terminated(self) -> bool:
        return self.end.ended and self.grammar.is_terminated()

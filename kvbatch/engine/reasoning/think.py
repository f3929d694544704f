"""`<think>...</think>` reasoning (Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3).

Where the reasoning starts depends on the chat template, so the parser reads the generation
prompt (the prompt's tokens after its last special token, the turn's opening, at most
PROMPT_TAIL): one that ends inside an open `<think>` (DeepSeek-R1, Qwen3-Thinking) starts the
answer in the reasoning; one that closed an empty block (Qwen3's and SmolLM3's thinking
switched off: `<think>\\n\\n</think>`) starts it in the answer; otherwise the answer opens its
own `<think>` or never reasons. An earlier turn's `</think>` is never read as this one's. A
`</think>` with no `<think>` before it still ends a reasoning (vLLM's deepseek_r1 reads it so).

    prompt ... <|im_start|>assistant\\n | <think>\\n reasoning \\n</think>\\n\\n answer <|im_end|>
                                        |  --------- reasoning tokens --------| content

Both markers must be single tokens of the vocabulary (added tokens in every checkpoint of
these families), so the split works on token ids whether or not the tokenizer marks them
special.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbatch.engine.reasoning.markers import marker_token
from kvbatch.engine.reasoning.parser import ReasoningSplit

START, END = "<think>", "</think>"
PROMPT_TAIL = 32  # tokens of the prompt's end that hold the generation prompt's markers


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` when each is one token of `tokenizer`, else None."""
    start, end = marker_token(tokenizer, START), marker_token(tokenizer, END)
    return None if start is None or end is None else (start, end)


class ThinkEnd:
    """Watches an answer for `</think>`: the grammar of a structured output starts after it."""

    def __init__(self, end_id: int, ended: bool) -> None:
        self.end_id = end_id
        self.ended = ended

    def accept(self, token_id: int) -> None:
        if token_id == self.end_id:
            self.ended = True


class ThinkParser:
    """Splits `<think>` reasoning from the answer (vLLM's `qwen3` and `deepseek_r1`)."""

    stop_token_ids: tuple[int, ...] = ()

    def __init__(self, tokenizer, name: str = "qwen3") -> None:
        ids = think_token_ids(tokenizer)
        if ids is None:
            raise ValueError(
                f"the reasoning parser {name!r} reads <think> and </think>, and this model's "
                "tokenizer does not hold each as one token: pick the parser of this model's "
                "format (--reasoning-parser), or none"
            )
        self.name = name
        self.tokenizer = tokenizer
        self.start_id, self.end_id = ids
        # a turn's opening (<|im_start|>, <｜Assistant｜>): the generation prompt starts after it
        self.turn_ids = frozenset(tokenizer.all_special_ids) - {self.start_id, self.end_id}

    def opens_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool | None:
        """True: the prompt leaves a `<think>` open; False: it closed one with `</think>`;
        None: its generation prompt holds neither."""
        for token in reversed(prompt_token_ids[-PROMPT_TAIL:]):
            if token == self.start_id:
                return True
            if token == self.end_id:
                return False
            if token in self.turn_ids:
                return None
        return None

    def reasoning_end(self, prompt_token_ids: Sequence[int]) -> ThinkEnd:
        return ThinkEnd(self.end_id, self.opens_in_reasoning(prompt_token_ids) is False)

    def split(
        self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
    ) -> ReasoningSplit:
        out = list(output_token_ids)
        opened = self.opens_in_reasoning(prompt_token_ids)
        begin = 0
        if opened is not True and self.start_id in out:
            at = out.index(self.start_id)
            if self.end_id not in out[:at]:
                opened, begin = True, at + 1
        end = out.index(self.end_id, begin) if self.end_id in out[begin:] else None
        if end is None:
            if opened:  # cut inside the reasoning, or the answer never closed it
                return ReasoningSplit(self._text(out[begin:]).strip(), None, len(out))
            return ReasoningSplit(None, self._text(out), 0)
        reasoning = self._text(out[begin:end]).strip()
        return ReasoningSplit(reasoning, self._text(out[end + 1 :]).lstrip(), end + 1)

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

"""vLLM's pairing of score texts, in plain Python: job validation pairs a score line's texts
without importing torch (`kvbatch status` reads jobs and must not)."""

from __future__ import annotations

from collections.abc import Sequence


def as_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of LLM.score's arguments: one text against many (either side), or two
    lists of the same length, item by item."""
    one_1, one_2 = isinstance(text_1, str), isinstance(text_2, str)
    if one_1 and one_2:
        return [(text_1, text_2)]
    if one_1:
        return [(text_1, t) for t in text_2]
    if one_2:
        return [(t, text_2) for t in text_1]
    if len(text_1) != len(text_2):
        raise ValueError(
            f"text_1 has {len(text_1)} texts and text_2 {len(text_2)}: give one text against "
            "many, or two lists of the same length"
        )
    return list(zip(text_1, text_2))

"""The context length (max_model_len) the engine chooses before the KV pool is sized, and
why, for the startup line. Plain Python, no torch: the jobs layer reads the reasons too."""

from __future__ import annotations

from typing import NamedTuple

CAPPED_AT_POOL = "what the KV cache holds"  # why max_model_len is less than the engine chose


class ContextChoice(NamedTuple):
    """The context length the engine runs before the pool is sized, and why (the startup line
    says it)."""

    length: int
    why: str


def chosen_context_len(asked: int, longest: int, limit: int) -> ContextChoice:
    """The context asked for; else (`asked` 0) the longest request the caller will send
    (`longest`, 0 = unknown) or the model's own, `limit`, whichever is shorter. More than the
    model has is refused. Windowed layers mask, so a sliding window does not cap it."""
    if asked > limit:
        raise ValueError(f"max_model_len={asked} exceeds the model's context of {limit}")
    if asked:
        return ContextChoice(asked, "max_model_len set")
    if 0 < longest < limit:
        return ContextChoice(longest, "the job's longest request")
    return ContextChoice(limit, "the model's context")

"""A pooled line's inputs (an embeddings line's texts, a score line's pairs) finish one by one;
the line's answer is written once all are in, or an error line naming the input an engine
refused."""

from __future__ import annotations

from typing import Any

from kvbatch.jobs.openai_format.validate import JobRequest


class PooledInputs:
    """Each line's outputs by input index until the last one arrives."""

    def __init__(self) -> None:
        self._waiting: dict[str, dict[int, Any]] = {}  # custom_id -> {input index: output}

    def add(self, req: JobRequest, index: int, out) -> list | None:
        """Record input `index`'s output; every output of the line, in input order, once all
        `req.num_inputs` are in, else None."""
        got = self._waiting.setdefault(req.custom_id, {})
        got[index] = out
        if len(got) < req.num_inputs:
            return None
        del self._waiting[req.custom_id]
        return [got[i] for i in range(req.num_inputs)]


def refusal(outputs: list, noun: str) -> str | None:
    """The first refused output's message, prefixed with which `noun` it was when the line has
    several; None when the engine refused none."""
    refused = next((o for o in outputs if getattr(o, "error", None) is not None), None)
    if refused is None:
        return None
    which = f"{noun} {outputs.index(refused)}: " if len(outputs) > 1 else ""
    return which + refused.error

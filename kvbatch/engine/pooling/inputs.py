"""The `input` of an embeddings request, as OpenAI accepts it, turned into a list of prompts.

OpenAI's `/v1/embeddings` takes a string, a list of strings, a list of token ids or a list of
such lists; each string or id list is one vector of the answer, in order.
"""

from __future__ import annotations

EmbeddingPrompt = str | list[int]


def embedding_inputs(value: object) -> list[EmbeddingPrompt]:
    """One prompt per vector to compute. Raises ValueError naming what is wrong: an empty
    input, an empty string, a mixed list, or a token id that is not an int."""
    if isinstance(value, str):
        prompts: list = [value]
    elif isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("input is empty: give a string, a list of strings or token ids")
        if all(_is_int(t) for t in value):  # token ids; a negative one is named below
            prompts = [list(value)]
        elif all(isinstance(v, str) for v in value):
            prompts = list(value)
        elif all(isinstance(v, (list, tuple)) for v in value):
            prompts = [list(v) for v in value]
        else:
            raise ValueError(
                "input must be a string, a list of strings, a list of token ids or a list of "
                "lists of token ids, not a mix of these"
            )
    else:
        raise ValueError(
            f"input must be a string, a list of strings or token ids, not {type(value).__name__}"
        )
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"input {i} is empty: every input needs at least one token")
        if isinstance(p, list) and not all(_is_token(t) for t in p):
            bad = next(t for t in p if not _is_token(t))
            if _is_int(bad):
                raise ValueError(f"input {i}: token id {bad} is negative: token ids are 0 or more")
            raise ValueError(f"input {i}: token id {bad!r} is not a non-negative int")
    return prompts


def _is_int(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _is_token(t: object) -> bool:
    return _is_int(t) and t >= 0

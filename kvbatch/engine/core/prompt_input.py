"""A request's prompt as token ids: what both engines (the decoder's LLMEngine and the
encoder's) accept, checked before anything is queued.

A prompt is a string (tokenized with the model's tokenizer), a list of token ids, or a dict
with `prompt_token_ids` (and the `prompt` text it came from) or `prompt`.
"""

from __future__ import annotations

PromptType = str | list[int] | dict


class ContextLengthError(ValueError):
    """A request longer than the engine's max_model_len (prompt, or prompt + max_tokens where
    the engine capped its context at the KV cache): jobs report it as
    context_length_exceeded."""


def prompt_token_ids(
    prompt: PromptType, tokenizer, vocab_size: int
) -> tuple[str | None, list[int]]:
    """(the prompt's text if it has one, its token ids). Raises ValueError naming what is
    wrong: another type, text without a tokenizer, an id outside the vocabulary."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), checked_token_ids(prompt["prompt_token_ids"], vocab_size)
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as token ids")
        return prompt, list(tokenizer.encode(prompt))
    if isinstance(prompt, (list, tuple)):
        return None, checked_token_ids(prompt, vocab_size)
    raise ValueError(
        f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}"
    )


def checked_token_ids(ids, vocab_size: int) -> list[int]:
    """The ids as a list of ints in [0, vocab_size). A request added mid-run is checked
    between two steps, on the decoders' time: for a 32k-token prompt a Python generator over
    the ids costs about two GPU decode steps in the decoders' gap at the long prompt's
    arrival. Plain ints (the usual case) are checked in three C-level passes instead, a few
    times faster; anything else goes through the generator, which names the offending id (by
    position: a None id is an offender too)."""
    ids = list(ids)
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size:
        return ids
    at = next(
        (
            i
            for i, t in enumerate(ids)
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
        ),
        None,
    )
    if at is not None:
        raise ValueError(f"token id {ids[at]!r} is not an int in [0, {vocab_size})")
    return ids


def check_embedding_input(token_ids: list[int], max_model_len: int) -> None:
    """An input to embed is computed whole, never truncated: refuse an empty or too long one."""
    if not token_ids:
        raise ValueError("the input is empty: give at least one token")
    if len(token_ids) > max_model_len:
        raise ContextLengthError(
            f"the input has {len(token_ids)} tokens but the model's context is "
            f"max_model_len={max_model_len}: shorten it"
        )

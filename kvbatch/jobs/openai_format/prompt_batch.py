"""Many lines' prompts as token ids at once: each rendered on its own (the chat template is a
Python call a line), all encoded in one call of the fast tokenizer, whose Rust side spreads a
batch over its threads and skips the per-call overhead of `tokenizer.encode`.

The ids are those `prompt_token_ids` gives line by line (tests/jobs/openai_format/
test_prompt_batch.py compares them): the Rust tokenizer is called directly only when
`tokenizer.encode` would call it the same way (a TokenizersBackend that overrides neither
`encode` nor `_encode_plus`, with no truncation or padding set and special tokens split as the
wrapper splits them); otherwise, and when a batch fails (each line then gets its own error),
`tokenizer.encode` a line at a time.
"""

from __future__ import annotations

from kvbatch.jobs.openai_format.prompts import (
    PromptError,
    RenderedPrompt,
    checked_prompt_ids,
    render_prompt,
)
from kvbatch.jobs.openai_format.validate import JobRequest


def prompts_token_ids(
    reqs: list[JobRequest], tokenizer, max_model_len: int, reasoning_parser: str | None = None
) -> list[list[int] | PromptError]:
    """`prompt_token_ids` of each request (chat or completions), in order: the ids, or the
    PromptError that line raises."""
    out: list[list[int] | PromptError | RenderedPrompt] = []
    for req in reqs:
        try:
            out.append(render_prompt(req, tokenizer, reasoning_parser))
        except PromptError as e:
            out.append(e)
    for flag in (False, True):
        todo = [i for i, r in enumerate(out) if _to_encode(r, flag)]
        if todo:
            encoded = encode_texts(tokenizer, [out[i].text for i in todo], flag)
            for i, ids in zip(todo, encoded):
                out[i] = ids if not isinstance(ids, Exception) else _failed(out[i], ids)
    for i, r in enumerate(out):
        if isinstance(r, RenderedPrompt):  # ids ready (harmony, ids given)
            r = r.ids
        if not isinstance(r, PromptError):
            try:
                r = checked_prompt_ids(r, max_model_len)
            except PromptError as e:
                r = e
        out[i] = r
    return out


def _to_encode(r, flag: bool) -> bool:
    return isinstance(r, RenderedPrompt) and r.text is not None and r.add_special_tokens == flag


def _failed(rendered: RenderedPrompt, exc: Exception) -> PromptError:
    return PromptError("invalid_prompt", f"{rendered.failure}: {exc}")


def encode_texts(
    tokenizer, texts: list[str], add_special_tokens: bool
) -> list[list[int] | Exception]:
    """`tokenizer.encode(text, add_special_tokens=...)` of each text, in one batch where the
    tokenizer allows; a text that cannot be encoded gets its exception."""
    backend = _direct_backend(tokenizer)
    if backend is not None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets
        try:
            return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]
        except Exception:  # one bad text fails the batch: find it line by line below
            pass
    out: list[list[int] | Exception] = []
    for text in texts:
        try:
            out.append(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except Exception as exc:
            out.append(exc)
    return out


def _direct_backend(tokenizer):
    """The Rust tokenizer, when encoding with it gives what `tokenizer.encode` gives; else
    None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    kind = type(tokenizer)
    if (
        getattr(kind.encode, "__qualname__", "") != "PreTrainedTokenizerBase.encode"
        or getattr(getattr(kind, "_encode_plus", None), "__qualname__", "")
        != "TokenizersBackend._encode_plus"
    ):
        return None  # a tokenizer class of its own (Mistral's, a slow one, ...)
    if backend.truncation is not None or backend.padding is not None:
        return None
    if bool(getattr(tokenizer, "split_special_tokens", False)) != backend.encode_special_tokens:
        return None
    return backend

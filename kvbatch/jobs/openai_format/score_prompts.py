"""The pairs of a `/v1/score` or `/v1/rerank` line as token ids, one engine input per pair.

    cross-encoder (a tokenizer without a chat template):  tokenizer(query, document)
    decoder reranker (Qwen3-Reranker):                     its chat template around the pair

the same prompts LLM.score runs (engine/pooling/score_pairs.py), so a job's scores are its
scores. A decoder reranker's prompt starts with the query, so the pairs of one query share a
prefix and the job's prefix grouping puts them side by side for the prefix cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvbatch.engine import YesNoReranker, reranker_prompt
from kvbatch.jobs.openai_format.prompts import PromptError
from kvbatch.jobs.openai_format.score_schemas import MODEL_MAX
from kvbatch.jobs.openai_format.validate import JobRequest


@dataclass(frozen=True)
class _Limits:
    """What reranker_prompt reads of an engine: the tokenizer and the length to fit."""

    tokenizer: object
    max_model_len: int


def pair_token_ids(req: JobRequest, tokenizer, max_model_len: int, model: str) -> list[list[int]]:
    """One prompt per pair of `req`, in order. Raises PromptError: the model cannot score
    pairs (a chat model's template: invalid_url), or a pair is longer than the model takes
    without truncate_prompt_tokens (context_length_exceeded)."""
    try:
        scorer = reranker_of(tokenizer, model)
    except ValueError as e:
        raise PromptError("invalid_url", f"url {req.url!r} needs a reranker: {e}") from e
    truncate = req.truncate_prompt_tokens is not None
    if req.truncate_prompt_tokens in (None, MODEL_MAX):
        limit = max_model_len
    else:
        limit = min(req.truncate_prompt_tokens, max_model_len)
    out = []
    for i, (query, document) in enumerate(req.pairs or ()):
        try:
            if scorer is None:
                cut = {"truncation": "longest_first", "max_length": limit} if truncate else {}
                ids = list(tokenizer(query, document, **cut)["input_ids"])
            else:
                ids = reranker_prompt(_Limits(tokenizer, limit), scorer, query, document, truncate)
        except ValueError as e:
            raise PromptError("invalid_prompt", f"pair {i} cannot be tokenized: {e}") from e
        if len(ids) > limit:
            raise PromptError(
                "context_length_exceeded",
                f"pair {i} has {len(ids)} tokens but the model takes at most {limit}: shorten "
                "it, or set truncate_prompt_tokens to cut the document",
            )
        out.append(ids)
    return out


@functools.lru_cache(maxsize=4)
def reranker_of(tokenizer, model: str) -> YesNoReranker | None:
    """None for a cross-encoder's tokenizer (no chat template: pairs are its two segments);
    the yes/no reading of a decoder reranker's; ValueError for a chat model's template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return YesNoReranker.of(tokenizer, model)

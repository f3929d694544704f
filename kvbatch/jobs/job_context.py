"""The context length a job runs at when --max-model-len is not set: its longest request.

    validate + tokenize every line (the model's tokenizer and its own context, read without
      the weights: kvbatch.jobs.model_info)
      --longest prompt + output cap (an embeddings line: its longest input)--> longest_request
      --the engine loads with longest_request--> max_model_len = the longest, capped at the
        model's context and at what the KV cache holds; the startup line says which

A line that sets no max_tokens may answer up to the context's end, so its output cap is the
room the model's context leaves and it asks for the model's whole context. An explicit
--max-model-len wins. When even the longest request does not fit the KV cache, the engine caps
its context at what the cache holds: a line with no cap of its own has its default cap cut to
the room left (`fit_default_cap`) and runs; one whose own prompt + max_tokens cannot fit is
refused by the engine with context_length_exceeded, naming the flags that would admit it.

A distributed job records its longest request in job.json (`longest_request`): every worker
runs the job at the same context, as `kvbatch run` would.
"""

from __future__ import annotations

import dataclasses

from kvbatch.engine import CAPPED_AT_POOL, SamplingParams
from kvbatch.jobs.openai_format.validate import JobRequest


def request_tokens(prompt_len: int, params: SamplingParams | None) -> int:
    """What one engine request may occupy: its prompt and its output cap (an embedding input
    generates nothing: `params` None)."""
    return prompt_len + (0 if params is None else params.max_tokens)


def engine_settings(settings: dict, longest_request: int) -> dict:
    """The engine keywords to load a job's model with: `settings` plus the job's longest
    request, unless max_model_len is set (it wins) or the job has no request."""
    if settings.get("max_model_len") or longest_request < 1:
        return settings
    return {**settings, "longest_request": longest_request}


def fit_default_cap(
    params: SamplingParams | None, req: JobRequest, prompt_len: int, max_model_len: int
) -> SamplingParams | None:
    """`params` with a default output cap (the line set no max_tokens) cut to the room the
    engine's context leaves: validation clamped it to the model's context, and an engine that
    capped its context at the KV cache would refuse it. A cap the line set itself is kept (the
    engine refuses it if it cannot fit, saying which flags would admit it)."""
    if params is None or req.max_tokens is not None:
        return params
    room = max_model_len - prompt_len
    if room < 1 or params.max_tokens <= room:
        return params
    return dataclasses.replace(params, max_tokens=room)


def runs_at(engine, longest_request: int) -> bool:
    """Whether `engine` (an LLM's) already runs at the context a job of `longest_request`
    would load it with: the same length, or the same cap at its KV cache. An encoder's context
    is its own (it has no KV cache to size)."""
    why = getattr(engine, "max_model_len_why", None)
    if why is None or longest_request < 1:
        return True
    wanted = min(longest_request, engine.model_context)
    if why == CAPPED_AT_POOL:
        return wanted >= engine.max_model_len
    return wanted == engine.max_model_len

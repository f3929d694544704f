"""A validated request without its text, as one JSON line, and back.

What a shard request holds of a line besides its index and token ids
(kvbatch.jobs.distributed.shards.ShardRequest, whose fields these are, in its order), and what
`kvbatch run` spills a line's request to (kvbatch.jobs.local.request_store): one format, read
back into the JobRequest the answer loop wants (messages, prompt and tools dropped: they were
only needed to tokenize).
"""

from __future__ import annotations

import dataclasses
import json

from kvbatch.engine import SamplingParams, StructuredOutputs
from kvbatch.jobs.openai_format.tools import ToolCalling
from kvbatch.jobs.openai_format.validate import JobRequest

# Kinds of params whose JSON is kept (a job's lines mostly share a few; a seed a line makes
# each its own, and those are not kept).
CACHED_PARAMS = 1024

_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # one, not one a call


def unit_record(req: JobRequest, params_json: dict | None = None) -> bytes:
    """What a shard request holds of an answered line besides its index and token ids, as
    one JSON line (ShardRequest's fields, in its order). `params_json` caches the params'
    JSON by their value (up to CACHED_PARAMS kinds)."""
    params = _params_json(req.params, params_json)
    embedding = None
    if req.is_embedding:
        embedding = {"dimensions": req.dimensions, "encoding_format": req.encoding_format}
    score = None
    if req.is_score:
        score = {"documents": req.documents, "top_n": req.top_n}
    calling = None if req.tool_calling is None else dataclasses.asdict(req.tool_calling)
    head = _compact([req.line, req.custom_id, req.url])
    tail = _compact([req.logprobs, req.max_tokens, req.model, embedding, calling, score])
    return f'{{"head":{head},"params":{params},"tail":{tail}}}\n'.encode()


def unit_fields(raw: bytes, prompts: list[list[int]]) -> dict:
    """A unit_record read back as ShardRequest's fields but its index (a dict, in the field
    order), `prompts` (its inputs' token ids) put in."""
    record = json.loads(raw)
    line, custom_id, url = record["head"]
    logprobs, max_tokens, model, embedding, calling, score = record["tail"]
    if embedding is not None:
        embedding = {"inputs": prompts, **embedding}
    if score is not None:
        score = {"inputs": prompts, **score}
    return {
        "line": line,
        "custom_id": custom_id,
        "url": url,
        "prompt_token_ids": prompts[0],
        "params": record["params"],
        "logprobs": logprobs,
        "max_tokens": max_tokens,
        "model": model,
        "embedding": embedding,
        "tool_calling": calling,
        "score": score,
    }


def sampling_params_of(params: dict) -> SamplingParams:
    """The params as a record holds them: JSON turned logit_bias ids into strings
    (SamplingParams reads those) and the structured-output constraint into an object."""
    params = dict(params)
    constraint = params.get("structured_outputs")
    if isinstance(constraint, dict):
        params["structured_outputs"] = StructuredOutputs(**constraint)
    return SamplingParams(**params)


def job_request_of(fields: dict) -> JobRequest:
    """The request as kvbatch.jobs.openai_format.responses.success_line wants it, from
    ShardRequest's fields (messages and prompt dropped)."""
    return JobRequest(
        line=fields["line"],
        custom_id=fields["custom_id"],
        url=fields["url"],
        messages=None,
        prompt=None,
        params=sampling_params_of(fields["params"]),
        logprobs=fields["logprobs"],
        model=fields["model"],
        max_tokens=fields["max_tokens"],
        tool_calling=None
        if fields["tool_calling"] is None
        else ToolCalling(**fields["tool_calling"]),
        **_pooled_fields(fields["embedding"], fields["score"]),
    )


def _pooled_fields(embedding: dict | None, score: dict | None) -> dict:
    if score is not None:
        return {
            "num_inputs": len(score["inputs"]),
            "documents": score["documents"],
            "top_n": score["top_n"],
        }
    if embedding is None:
        return {}
    return {
        "dimensions": embedding["dimensions"],
        "encoding_format": embedding["encoding_format"],
        "num_inputs": len(embedding["inputs"]),
    }


def _params_json(params, cache: dict | None) -> str:
    if cache is None:
        return _compact(dataclasses.asdict(params))
    try:
        return cache[params]
    except KeyError:
        text = _compact(dataclasses.asdict(params))
        if len(cache) < CACHED_PARAMS:
            cache[params] = text
        return text
    except TypeError:  # a logit_bias dict makes the params unhashable: not cached
        return _compact(dataclasses.asdict(params))


def _compact(value) -> str:
    return _COMPACT.encode(value)

"""The answer loop shared by `kvbatch run` and a worker's shard: feed a job's engine requests
in prefix order, and turn each finished output into its OpenAI batch line.

    EngineRequest(key, input, token ids, params)  --feed_in_order-->  engine outputs
      --"<key>:<input>" back to the line-->  success_line (chat, completions, tool calls,
      refusals) | EmbeddingLines (an embeddings line once all its inputs have a vector)
      | ScoreLines (a score or rerank line once all its pairs have a score)
      -->  Finished(key, input, output, line)

A line is named by the caller's `key` (the local run: its first entry in the token store; a
shard: its index in the job); an embeddings line runs one engine request per input, so the
engine's request id is `<key>:<input>` for every request, and the loop reads it back to find
the line. Outputs whose id does not parse, or whose key the caller does not know, belong to
someone else using the same engine and are passed over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvbatch.engine import SamplingParams
from kvbatch.jobs.grouping import feed_in_order
from kvbatch.jobs.job_context import fit_default_cap
from kvbatch.jobs.openai_format.embedding_lines import EmbeddingLines
from kvbatch.jobs.openai_format.responses import success_line
from kvbatch.jobs.openai_format.score_lines import ScoreLines, pair_params
from kvbatch.jobs.openai_format.validate import JobRequest


@dataclass(frozen=True)
class EngineRequest:
    """One request for the engine: a line's prompt, or one input of an embeddings line, or
    one pair of a score or rerank line."""

    key: int  # the line, as the caller names it
    input: int  # 0, or which input of an embeddings line
    token_ids: list[int]
    params: SamplingParams | None  # None: embed (prefill only)


@dataclass(frozen=True)
class Finished:
    """One engine output of the job, and the line it completed (None while an embeddings line
    waits for its other inputs)."""

    key: int
    input: int
    output: Any  # RequestOutput, or EmbeddingOutput for an embeddings input
    line: dict | None


def request_id(key: int, input_index: int) -> str:
    return f"{key}:{input_index}"


def parse_request_id(rid: str) -> tuple[int, int] | None:
    """(key, input) of an id `request_id` made, or None for anyone else's."""
    key, sep, part = rid.partition(":")
    if not sep or not key.isdigit() or not part.isdigit():
        return None
    return int(key), int(part)


def _fitted(r: EngineRequest, request_of, max_model_len: int, pairs) -> SamplingParams | None:
    req = request_of(r.key)
    if req is None:
        return r.params
    if req.is_score:
        return pairs  # how this engine runs a pair (score_lines.pair_params)
    return fit_default_cap(r.params, req, len(r.token_ids), max_model_len)


@dataclass(frozen=True)
class LineContext:
    """What every answer line of a job carries: the same for every worker of a job (they come
    from its manifest), so ids agree however the job was split."""

    model_name: str
    batch_id: str
    created: int


def answer(
    engine,
    requests: Iterable[EngineRequest],
    request_of: Callable[[int], JobRequest | None],
    context: LineContext,
    *,
    window: int = 0,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[Finished]:
    """Run `requests` on `engine` (an LLMEngine) in the order given, at most `window` inside
    at once (0: 4 x max_num_seqs), and yield each of their outputs as it finishes, with the
    line it completed. `request_of(key)` is the validated line (None: not this job's). A
    request the engine refuses gives its line an error line; a line's default output cap is
    cut to the room the engine's context leaves (kvbatch.jobs.job_context). Stops early when
    `should_stop` says so (see feed_in_order); the caller tells the unanswered lines by what
    was not yielded.
    """
    window = window or 4 * engine.config.scheduler.max_num_seqs
    pairs = pair_params(engine)
    feed = (
        (
            request_id(r.key, r.input),
            r.token_ids,
            _fitted(r, request_of, engine.max_model_len, pairs),
        )
        for r in requests
    )
    vectors = EmbeddingLines(context.model_name, engine, context.batch_id)
    scores = ScoreLines(context.model_name, engine, context.batch_id, context.created)
    for out in feed_in_order(engine, feed, window, should_stop):
        parsed = parse_request_id(out.request_id)
        req = None if parsed is None else request_of(parsed[0])
        if req is None:  # someone else's request in the same engine
            continue
        key, input_index = parsed
        if req.is_embedding:
            line = vectors.add(req, input_index, out)
        elif req.is_score:
            line = scores.add(req, input_index, out)
        else:
            line = success_line(
                req,
                out,
                model=context.model_name,
                tokenizer=engine.tokenizer,
                batch_id=context.batch_id,
                created=context.created,
                reasoning=getattr(engine, "reasoning", None),
            )
        yield Finished(key, input_index, out, line)

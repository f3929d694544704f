"""The output lines of `/v1/score` and `/v1/rerank` requests, built as their pairs' scores
arrive, in vLLM's shapes:

    score:  {"id": "score-<key>", "object": "list", "created": ..., "model": ...,
             "data": [{"index": 0, "object": "score", "score": 0.93}, ...], "usage": {...}}
    rerank: {"id": "rerank-<key>", "model": ..., "usage": {...},
             "results": [{"index": 2, "document": {"text": ...}, "relevance_score": 0.93}, ...]}
            (best first, the top_n best when set)

Each pair runs as one pooled engine request (as an embeddings input does): a cross-encoder's
ScoreOutput carries its score; a decoder reranker's last state is projected on its yes and no
rows (engine/pooling/yes_no.py). One pair the engine refuses makes the line an error record.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbatch.engine import LAST_STATE, YesNoReranker
from kvbatch.jobs.openai_format.pooled_inputs import PooledInputs, refusal
from kvbatch.jobs.openai_format.responses import embedding_line, error_line, response_key
from kvbatch.jobs.openai_format.validate import JobRequest, LineError


@dataclass(frozen=True)
class CrossEncoderPair:
    """A pair for a cross-encoder: scored by its classification head."""

    def add_to(self, engine, token_ids: list[int], request_id: str) -> str:
        return engine.add_score_request_ids(token_ids, request_id=request_id)


@dataclass(frozen=True)
class RerankerPrompt:
    """A pair's prompt for a decoder reranker: prefilled, its last state kept as it is."""

    def add_to(self, engine, token_ids: list[int], request_id: str) -> str:
        return engine.add_embedding_request(token_ids, request_id=request_id, pooling=LAST_STATE)


@dataclass(frozen=True)
class Unscorable:
    """A pair on an engine that cannot score one: refused, saying why."""

    why: str

    def add_to(self, engine, token_ids: list[int], request_id: str) -> str:
        raise ValueError(self.why)


def pair_params(engine) -> CrossEncoderPair | RerankerPrompt | Unscorable:
    """How `engine` runs a pair (kvbatch.jobs.grouping.EngineAdd): a cross-encoder scores it,
    a decoder reranker prefills it, any other decoder refuses it."""
    if hasattr(engine, "add_score_request_ids"):
        return CrossEncoderPair()
    try:
        YesNoReranker.of(engine.tokenizer, engine.config.model)
    except ValueError as e:
        return Unscorable(f"this model cannot score pairs: {e}")
    return RerankerPrompt()


class ScoreLines:
    """Collects each score or rerank line's outputs until all its pairs are in."""

    def __init__(self, model: str, engine, batch_id: str, created: int) -> None:
        self.model = model
        self.engine = engine
        self.batch_id = batch_id
        self.created = created
        self._inputs = PooledInputs()
        self._reranker: YesNoReranker | None = None

    def add(self, req: JobRequest, pair: int, out) -> dict | None:
        """Record pair `pair`'s output; the line's output (or error) line once every pair is
        in, else None."""
        outputs = self._inputs.add(req, pair, out)
        if outputs is None:
            return None
        refused = refusal(outputs, "pair")
        if refused is not None:
            return self._error(req, "invalid_prompt", refused)
        scores = self._scores(outputs)
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        cached = sum(getattr(o, "num_cached_tokens", 0) for o in outputs)  # decoder rerankers
        key = response_key(self.batch_id, req.line, req.custom_id)
        if req.is_rerank:
            multi = next((s for s in scores if isinstance(s, list)), None)
            if multi is not None:
                return self._error(
                    req, "invalid_url", f"the model gives {len(multi)} labels per pair; "
                    "/v1/rerank ranks by one score: use /v1/score",
                )  # fmt: skip
            body = rerank_body(key, self.model, req.documents or [], scores, req.top_n, tokens)
        else:
            body = score_body(key, self.model, self.created, scores, tokens)
        body["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return embedding_line(req, body, batch_id=self.batch_id)

    def _scores(self, outputs: list) -> list[float | list[float]]:
        if hasattr(outputs[0], "score"):  # a cross-encoder's ScoreOutput
            return [o.score for o in outputs]
        if self._reranker is None:
            self._reranker = YesNoReranker.of(self.engine.tokenizer, self.engine.config.model)
        states = [o.embedding for o in outputs]
        return self._reranker.scores(states, self.engine.model.output_embedding)

    def _error(self, req: JobRequest, code: str, message: str) -> dict:
        err = LineError(req.line, req.custom_id, code, f"line {req.line}: {message}")
        return error_line(err, batch_id=self.batch_id)


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def score_body(key: str, model: str, created: int, scores: list, tokens: int) -> dict:
    """vLLM's ScoreResponse: one score per pair, in the pairs' order."""
    return {
        "id": "score-" + key,
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": _usage(tokens),
    }


def rerank_body(
    key: str, model: str, documents: list[str], scores: list[float], top_n: int | None,
    tokens: int,
) -> dict:  # fmt: skip
    """vLLM's RerankResponse: the documents best first (ties in input order), top_n kept."""
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[: top_n or len(scores)]
    return {
        "id": "rerank-" + key,
        "model": model,
        "usage": _usage(tokens),
        "results": [
            {"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]}
            for i in ranked
        ],
    }

"""`LLM.score`: relevance scores of (query, document) pairs, on either engine.

    cross-encoder (BERT-family ...ForSequenceClassification): the encoder engine's score
        requests, each pair one input of two segments, scored by the classification head
    decoder reranker (Qwen3-Reranker): the pair rendered by the model's chat template,
        prefilled as an embedding request with the last state kept (yes_no.py)

Both run the engine's streaming API (add requests, step() until done), so a job's score lines
take the same path; pairs come back in the order given.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbatch.engine.pooling.pairs import as_pairs as as_pairs  # LLM.score's pairing
from kvbatch.engine.pooling.yes_no import LAST_STATE, YesNoReranker


def score_pairs(
    engine, pairs: Sequence[tuple[str, str]], truncate: bool = False, tag: str = "score"
) -> list[float | list[float]]:
    """One score per (query, document) pair, in order. ValueError names the pair at fault
    (too long without `truncate`, empty) and nothing runs then."""
    scorer = None
    if not hasattr(engine, "add_score_request"):  # a decoder: read as a yes/no reranker
        scorer = YesNoReranker.of(engine.tokenizer, engine.config.model)
    index_of: dict[str, int] = {}
    for i, (query, document) in enumerate(pairs):
        rid = f"{tag}-{id(pairs)}-{i}"
        try:
            if scorer is None:
                engine.add_score_request(query, document, request_id=rid, truncate=truncate)
            else:
                ids = reranker_prompt(engine, scorer, query, document, truncate)
                engine.add_embedding_request(ids, request_id=rid, pooling=LAST_STATE)
        except ValueError as e:
            for queued in index_of:
                engine.abort_request(queued)
            raise ValueError(f"pair {i}: {e}") from e
        index_of[rid] = i
    results: dict[int, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in index_of:
                results[index_of[out.request_id]] = out
    ordered = [results[i] for i in range(len(pairs))]
    if scorer is None:
        return [out.score for out in ordered]
    if not ordered:
        return []
    states = torch.stack([out.embedding for out in ordered])
    return scorer.scores(states, engine.model.output_embedding)


def reranker_prompt(
    engine, scorer: YesNoReranker, query: str, document: str, truncate: bool
) -> list[int]:
    """The pair's prompt ids; with `truncate`, the document cut from its end to fit."""
    tokenizer, limit = engine.tokenizer, engine.max_model_len
    ids = scorer.prompt_token_ids(tokenizer, query, document)
    if len(ids) <= limit or not truncate:
        return ids
    doc_ids = tokenizer.encode(document, add_special_tokens=False)
    keep = len(doc_ids) - (len(ids) - limit)
    while keep > 0:
        cut = tokenizer.decode(doc_ids[:keep], skip_special_tokens=True)
        ids = scorer.prompt_token_ids(tokenizer, query, cut)
        if len(ids) <= limit:
            return ids
        keep -= max(1, len(ids) - limit)  # a round trip may add a token or two
    raise ValueError(f"the query alone fills the model's max_model_len={limit}: shorten it")

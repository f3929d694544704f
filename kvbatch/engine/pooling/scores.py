"""Relevance scores of (query, document) pairs: what the engine hands back for a score request,
and the activation that turns a reranker's logit into its score.

sentence-transformers' CrossEncoder is the reference: a model with one label (a reranker)
gives sigmoid(logit), a score in (0, 1); several labels give the raw logits; a checkpoint may
name another activation in config.json (`sentence_transformers.activation_fn`, or before
version 4 `sbert_ce_default_activation_function`). vLLM's /score answers the same numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
    "torch.nn.Sigmoid": torch.sigmoid,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.Identity": lambda x: x,
}


@dataclass
class ScoreOutput:
    """One pair's score (vLLM's ScoringRequestOutput, trimmed): a float for a one-label
    reranker, one float per label otherwise."""

    request_id: str
    score: float | list[float]
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


def score_activation(model: str | Path, num_labels: int):
    """The function from logits [n, num_labels] to scores, as CrossEncoder picks it. Raises
    ValueError for an activation it names that the engine does not know."""
    config = Path(model).expanduser() / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    named = (hf.get("sentence_transformers") or {}).get("activation_fn") or hf.get(
        "sbert_ce_default_activation_function"
    )
    if named is None:
        return torch.sigmoid if num_labels == 1 else _ACTIVATIONS["torch.nn.Identity"]
    if named not in _ACTIVATIONS:
        raise ValueError(
            f"{config}: activation_fn {named!r} is not supported (kvbatch applies "
            "torch.nn.Sigmoid or torch.nn.Identity to a reranker's logits)"
        )
    return _ACTIVATIONS[named]


def as_scores(logits: torch.Tensor, activation) -> list[float | list[float]]:
    """[n, num_labels] logits -> n scores: floats for one label, lists of floats otherwise."""
    scores = activation(logits.float()).cpu()
    if scores.shape[1] == 1:
        return scores[:, 0].tolist()
    return scores.tolist()

"""How far a quantized model's answers are from float32's, in three figures for the docs:
greedy tokens equal before the first divergence, the mean KL divergence of next-token
distributions over a text, and each model's perplexity on that text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tests.engine.model.test_model import prefill_logits


@dataclass(frozen=True)
class Agreement:
    mean_kl: float  # KL(float32 || quantized) per position, in nats
    perplexity_ref: float
    perplexity: float
    top1_agreement: float  # share of positions where both predict the same next token


def agreement_on_text(reference_model, model, ids: Sequence[int], chunk: int = 256) -> Agreement:
    """Compare two of our models on one text (token ids), every position's next token."""
    ref = prefill_logits(reference_model, list(ids), chunk).double().log_softmax(-1)[:-1]
    got = prefill_logits(model, list(ids), chunk).double().log_softmax(-1)[:-1]
    targets = torch.tensor(ids[1:])
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()

    def ppl(logp: torch.Tensor) -> float:
        return logp.gather(1, targets[:, None]).mean().neg().exp().item()

    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    return Agreement(kl, ppl(ref), ppl(got), top1)


def tokens_before_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

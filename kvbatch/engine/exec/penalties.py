"""Penalties and logit bias: the logits changes a request asks for before sampling.

Applied to the whole batch at once on the logits' device: the rows that ask for them are
gathered, changed with tensor ops and scattered back, so a batch where no row asks pays
nothing (the sampler skips this module entirely). The order follows vLLM's sampler: logit
bias first, then repetition, frequency and presence penalties.

- repetition_penalty (Hugging Face's RepetitionPenaltyLogitsProcessor, from the CTRL paper,
  arXiv 1909.05858): every token seen in the prompt or the output has its logit divided by
  the penalty when positive, multiplied when negative;
- frequency_penalty and presence_penalty (OpenAI): over the generated tokens only,
  logit -= frequency_penalty * count + presence_penalty * (count > 0);
- logit_bias (OpenAI): a bias added to given tokens' logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from kvbatch.engine.core.sampling_params import SamplingParams


class TokenHistory(NamedTuple):
    """One row's tokens so far: what the penalties count."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


def token_histories(seqs: Sequence) -> list[TokenHistory] | None:
    """The histories of a batch's sequences (objects with `params`, `prompt_token_ids` and
    `output_token_ids`), or None when none has a penalty (nothing is copied then)."""
    if not any(s.params.uses_penalties for s in seqs):
        return None
    return [TokenHistory(s.prompt_token_ids, s.output_token_ids) for s in seqs]


def _flat(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row index, value) of every item of `lists`, flattened, as int64 arrays."""
    lens = np.fromiter((len(x) for x in lists), np.int64, len(lists))
    values = np.fromiter(itertools.chain.from_iterable(lists), np.int64, int(lens.sum()))
    return np.repeat(np.arange(len(lists), dtype=np.int64), lens), values


def _to_device(a: np.ndarray, device: torch.device) -> Tensor:
    """A host array on `device`; on CUDA through pinned memory without blocking, so the copy
    does not wait for the steps already queued on the stream."""
    t = torch.from_numpy(a)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class PenaltyTensors:
    """The penalised rows of a batch and what they have seen, on the logits' device."""

    rows: Tensor  # [R] int64: rows of the batch with a penalty
    output_counts: Tensor  # [R, V] float32: how often each token was generated
    seen: Tensor | None  # [R, V] bool: in prompt or output (None: no repetition penalty)
    repetition: Tensor  # [R] float32
    frequency: Tensor  # [R] float32
    presence: Tensor  # [R] float32

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory],
        vocab_size: int,
        device: torch.device,
    ) -> PenaltyTensors | None:
        """The tensors of the rows whose params use a penalty; None when no row does."""
        rows = [i for i, p in enumerate(params) if p.uses_penalties]
        if not rows:
            return None
        row_of, token = _flat([histories[i].output_token_ids for i in rows])
        counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
        row_d, token_d = _to_device(row_of, device), _to_device(token, device)
        counts.index_put_((row_d, token_d), torch.ones_like(token_d, dtype=torch.float32), True)
        repetition = [params[i].repetition_penalty for i in rows]
        seen = None
        if any(r != 1.0 for r in repetition):
            prompt_row, prompt_token = _flat([histories[i].prompt_token_ids for i in rows])
            seen = counts > 0
            seen[_to_device(prompt_row, device), _to_device(prompt_token, device)] = True
        floats = _to_device(
            np.array(
                [
                    repetition,
                    [params[i].frequency_penalty for i in rows],
                    [params[i].presence_penalty for i in rows],
                ],
                dtype=np.float32,
            ),
            device,
        )
        return cls(
            rows=_to_device(np.array(rows, dtype=np.int64), device),
            output_counts=counts,
            seen=seen,
            repetition=floats[0],
            frequency=floats[1],
            presence=floats[2],
        )

    def apply(self, logits: Tensor) -> None:
        """Penalise `logits` [B, V] float32 in place."""
        x = logits[self.rows]  # [R, V]
        if self.seen is not None:
            rep = self.repetition[:, None]
            x = torch.where(self.seen, torch.where(x > 0, x / rep, x * rep), x)
        counts = self.output_counts
        x = x - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0)
        logits[self.rows] = x


@dataclass
class LogitBias:
    """Every (row, token, bias) of the batch's logit_bias maps, flattened."""

    rows: Tensor  # [N] int64
    token_ids: Tensor  # [N] int64
    bias: Tensor  # [N] float32

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device) -> LogitBias | None:
        """None when no row has a logit_bias."""
        maps = [p.logit_bias or {} for p in params]
        if not any(maps):
            return None
        row_of, token = _flat([list(m) for m in maps])
        bias = np.fromiter(itertools.chain.from_iterable(m.values() for m in maps), np.float32)
        return cls(_to_device(row_of, device), _to_device(token, device), _to_device(bias, device))

    def apply(self, logits: Tensor) -> None:
        """Add the biases to `logits` [B, V] in place."""
        logits.index_put_((self.rows, self.token_ids), self.bias, accumulate=True)

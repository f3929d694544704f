"""How long a step takes, learned from the steps the engine has run: sizes long prompts' chunks.

The long-prefill target is about time, not tokens: while a 32k prompt is prefilled, no
decoding request should wait more than a few plain decode steps for its next token. How many
prompt tokens fit in that time depends on the GPU, the model and how deep into the prompt the
chunk is (its attention reads every earlier token), and a fixed token cap is right for one
of them at most: on the H200 the 2,048-token cap gave gaps of ~13 plain steps. So the engine
times its steps and fits, over the last mixed steps (decodes plus a prompt's chunk),

    mixed step - plain decode step  =  e + a * tokens + b * pairs / c

where `pairs` counts the chunk's query-key pairs (n tokens after `context` cached ones:
n * context + n (n + 1) / 2) and c is the model's attention break-even context (attention
FLOPs per context token against a token's matmul FLOPs), so that a == b when attention runs
at the matmuls' FLOP rate (on the H200 it ran at about half, b ~ 2a: the fit finds that),
and e is what a mixed step costs before any token (on CUDA it runs eagerly while plain
steps replay a graph). The fit is least squares over decayed sums, every coefficient >= 0.
A chunk is then the largest n whose predicted extra time fits `(ratio - 1)` plain steps.

Growing chunks safely: before the first mixed step there is nothing to fit, so the first
chunk is a small probe (PROBE_TOKENS), and no chunk is more than GROWTH times the largest one
measured, so a fit from small chunks is never trusted far beyond what it has seen.
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

PROBE_TOKENS = 64  # the first chunk, before any mixed step has been timed
GROWTH = 2  # no chunk is more than this many times the largest one measured
MIN_CHUNK = 16  # never cut a prompt finer than this: each step also pays for the decodes
PLAIN_WINDOW = 16  # a plain step is the median of the last this many (one slow one, e.g. a
# first step at a new shape, must not move the budget)
MIXED_DECAY = 0.9  # each older mixed step counts this much less in the fit
# Pulls the fit toward a == b (attention at the matmuls' FLOP rate), in proportion to the
# data's scale: decides the split only when the chunks seen cannot (all at one context).
PRIOR_WEIGHT = 1e-4


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the cost model counts it."""

    num_decodes: int  # rows of running sequences past their prompt
    prefill_tokens: int  # prompt tokens (chunks of sequences still in their prompt)
    prefill_pairs: int  # query-key pairs of those chunks' attention
    longest_chunk: int = 0  # the largest prompt chunk in the step

    @property
    def is_plain(self) -> bool:
        return self.num_decodes > 0 and self.prefill_tokens == 0

    @property
    def is_mixed(self) -> bool:
        return self.num_decodes > 0 and self.prefill_tokens > 0


def chunk_pairs(num_tokens: int, context: int) -> int:
    """Query-key pairs of a causal chunk of `num_tokens` after `context` cached tokens."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Plain decode steps' time (a running median) and what a prompt chunk adds (a fit)."""

    def __init__(self, ratio: float, break_even_context: int) -> None:
        if ratio <= 1:
            raise ValueError(f"the step ratio must be > 1 (a plain step is 1), got {ratio}")
        self.ratio = ratio
        self.break_even = break_even_context  # 0: attention not counted
        self.plain_seconds: float | None = None  # the median of `_plain`
        self._plain: deque[float] = deque(maxlen=PLAIN_WINDOW)
        self.largest_measured = 0  # the longest chunk in a timed mixed step
        self.num_mixed = 0
        self._xx = np.zeros((3, 3))  # decayed sums of x x^T, x = (1, tokens, attention)
        self._xy = np.zeros(3)  # ... of x y, y = the step's time over a plain step's
        self._fit: tuple[float, float, float] | None = None  # coefficients(), until observe
        self._said_unreachable = False

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A finished step's shape and its measured time."""
        if shape.is_plain:
            self._plain.append(seconds)
            self.plain_seconds = statistics.median(self._plain)
        elif shape.is_mixed and self.plain_seconds is not None:
            x = np.array([1.0, shape.prefill_tokens, self._attention_tokens(shape.prefill_pairs)])
            self._xx = MIXED_DECAY * self._xx + np.outer(x, x)
            self._xy = MIXED_DECAY * self._xy + x * (seconds - self.plain_seconds)
            self.num_mixed += 1
            self._fit = None
            self.largest_measured = max(self.largest_measured, shape.longest_chunk)

    def _attention_tokens(self, pairs: int) -> float:
        """Query-key pairs in plain tokens' worth of FLOPs."""
        return pairs / self.break_even if self.break_even else 0.0

    def coefficients(self) -> tuple[float, float, float] | None:
        """(e, a, b): seconds per mixed step, per prompt token and per token's worth of
        attention; None before any mixed step is timed."""
        if not self.num_mixed:
            return None
        if self._fit is None:
            m, r = self._xx.copy(), self._xy
            lam = PRIOR_WEIGHT * (m[1, 1] + m[2, 2])  # penalty lam * (a - b)^2
            m[1:, 1:] += lam * np.array([[1.0, -1.0], [-1.0, 1.0]])
            e, a, b = (float(v) for v in nonnegative_least_squares(m, r))
            self._fit = e, a, b
        return self._fit

    def describe(self) -> dict[str, float | int | None]:
        """What the model has learned, for reports: seconds of a plain step and the fit."""
        e, a, b = self.coefficients() or (None, None, None)
        return {
            "plain_step_s": self.plain_seconds,
            "mixed_steps": self.num_mixed,
            "fixed_s": e,
            "per_token_s": a,
            "per_attention_token_s": b,
            "break_even_context": self.break_even,
            "ratio": self.ratio,
        }

    def chunk_cap(self, context: int) -> int | None:
        """The most prompt tokens after `context` cached ones that keep a step with decodes
        within `ratio` plain steps; None when the model cannot say (no plain step timed
        yet, or a mixed step's fixed cost alone is over the budget, so that no chunk size
        meets it): the caller keeps its token cap."""
        if self.plain_seconds is None:
            return None
        if not self.num_mixed:
            return PROBE_TOKENS
        e, a, b = self.coefficients()
        budget = (self.ratio - 1) * self.plain_seconds - e
        if budget <= 0:
            if not self._said_unreachable:
                self._said_unreachable = True
                log.warning(
                    "a step with a prompt chunk costs %.2f ms more than a plain decode step "
                    "(%.2f ms) before any token: no chunk size keeps it within "
                    "long_prefill_step_ratio=%g, so long prompts keep the token cap",
                    e * 1e3,
                    self.plain_seconds * 1e3,
                    self.ratio,
                )
            return None
        # a n + b (n context + n (n + 1) / 2) / c <= budget: the positive root
        per_pair = b / self.break_even if self.break_even else 0.0
        linear, quadratic = a + per_pair * (context + 0.5), per_pair / 2
        if quadratic > 0:
            n = (math.sqrt(linear * linear + 4 * quadratic * budget) - linear) / (2 * quadratic)
        else:
            n = budget / linear if linear > 0 else math.inf
        most = GROWTH * max(self.largest_measured, PROBE_TOKENS)
        return max(MIN_CHUNK, int(min(n, most)))


def nonnegative_least_squares(gram: np.ndarray, xy: np.ndarray) -> np.ndarray:
    """argmin over theta >= 0 of theta' G theta - 2 theta' r, from the normal equations'
    sums (G = X'X, r = X'y): every subset of free coefficients is solved and the best
    feasible one kept, fewer coefficients on a tie. Three coefficients make seven subsets;
    one the data cannot tell apart (e.g. every chunk the same size: a fixed cost or a cost
    per token?) is skipped."""
    k = len(xy)
    best, best_loss = np.zeros(k), 0.0  # all zero is always feasible
    for size in range(1, k + 1):
        for free in itertools.combinations(range(k), size):
            idx = list(free)
            sub_gram = gram[np.ix_(idx, idx)]
            scale = np.sqrt(np.diag(sub_gram))
            if np.any(scale == 0) or np.linalg.cond(sub_gram / np.outer(scale, scale)) > 1e8:
                continue
            sub = np.linalg.solve(sub_gram, xy[idx])
            if np.any(sub < 0):
                continue
            theta = np.zeros(k)
            theta[idx] = sub
            loss = float(theta @ gram @ theta - 2 * theta @ xy)
            if loss < best_loss - 1e-9 * abs(best_loss):
                best, best_loss = theta, loss
    return best

"""Per-request sampling options, validated once when the request arrives."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

MAX_LOGPROBS = 20
"""Largest top-n a request may ask for: bounds the `torch.topk` the sampler runs per step."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as greedy: dividing logits by them overflows float32."""


def _is_int(x: object) -> bool:
    # bool is an int subclass; `max_tokens=True` is a bug, not 1. The `type(x) is int` fast path
    # skips the slow ABC isinstance (numpy ints still pass through it).
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_real(x: object) -> bool:
    t = type(x)
    return t is float or t is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each output token of one request (close to vLLM's `SamplingParams`).

    Frozen so that a request's options cannot change under the scheduler's feet; use
    `dataclasses.replace` to derive a variant (it re-runs validation). After construction
    `stop` is a `tuple[str, ...]` and `stop_token_ids` a `tuple[int, ...]` (empty when None).
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 or -1 = disabled; else >= 1
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None  # per-request seed: reproducible whatever the batch
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; n = chosen token's logprob plus the top-n

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise through object.__setattr__

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if type(self.max_tokens) is not int:
            set_(self, "max_tokens", int(self.max_tokens))

        if not _is_real(self.temperature) or not (0 <= self.temperature < float("inf")):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if type(self.temperature) is not float:
            set_(self, "temperature", float(self.temperature))

        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if type(self.top_p) is not float:
            set_(self, "top_p", float(self.top_p))

        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an int: 0 or -1 to disable, else >= 1, got {self.top_k!r}"
            )
        if type(self.top_k) is not int or self.top_k < 0:
            set_(self, "top_k", max(int(self.top_k), 0))  # -1 -> 0: one spelling of "disabled"

        if not _is_real(self.min_p) or not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if type(self.min_p) is not float:
            set_(self, "min_p", float(self.min_p))

        if self.seed is not None:
            # Non-negative int64: the sampler keeps seeds in an int64 tensor, -1 = unseeded.
            if not _is_int(self.seed) or not (0 <= self.seed < 2**63):
                raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
            if type(self.seed) is not int:
                set_(self, "seed", int(self.seed))

        set_(self, "stop", _normalise_stop(self.stop))
        set_(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")  # noqa: TRY004

        if self.logprobs is not None:
            if not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS):
                raise ValueError(
                    f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
                )
            if type(self.logprobs) is not int:
                set_(self, "logprobs", int(self.logprobs))
        # Read per row per step by the runner: greedy rows without logprobs need no sampler.
        set_(self, "argmax_only", self.greedy and self.logprobs is None)

    @property
    def greedy(self) -> bool:
        """True when the request always takes the most likely token (argmax of the logits)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(
            f"stop must be None, a non-empty str or a list of non-empty str, got {stop!r}"
        )
    return tuple(items)


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_token_ids must be None or a list of ints >= 0, got {ids!r}")
    return tuple(int(i) for i in ids)

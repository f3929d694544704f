"""Per-request sampling options, validated once when the request arrives."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvbatch.engine.structured.params import StructuredOutputs

MAX_LOGPROBS = 20
"""Largest top-n a request may ask for: bounds the `torch.topk` the sampler runs per step."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as greedy: dividing logits by them overflows float32."""

MAX_N = 128
"""Most choices one request may ask for: each is a sequence of its own in the batch."""

MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a logit_bias value (-100 bans a token, 100 all but forces it)."""

MAX_PENALTY = 2.0
"""OpenAI's bound on |presence_penalty| and |frequency_penalty|."""

# The sampler works in float32: a value that rounds to 0 or overflows there changes meaning
# (a top_p of 1e-46 becomes 0 and masks every token; a repetition penalty of 1e-46 divides
# logits by 0). Below and above these bounds a value is refused, naming the bound.
MIN_TOP_P = 2.0**-126
"""float32's smallest normal number: a smaller top_p rounds to 0 (or to a subnormal that a
GPU flushes to 0)."""

MIN_REPETITION_PENALTY = 1e-30
MAX_REPETITION_PENALTY = 1e30
"""Logits divided or multiplied by a repetition penalty in this range stay finite in float32
(|logit| up to 3e8)."""

MAX_TEMPERATURE = 1e30
"""Above this, dividing logits by the temperature leaves float32 nothing but zeros."""


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
    # n choices per prompt: the children share the prompt's KV blocks; choice i samples with
    # seed + i when a seed is given (kvbatch.engine.core.choices).
    n: int = 1
    # OpenAI: logit -= frequency_penalty * count + presence_penalty * (count > 0), counting
    # the tokens generated so far.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face (CTRL paper): over prompt and generated tokens, a positive logit is divided
    # by it, a negative one multiplied. 1 = off.
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None  # token id -> bias added to its logit
    structured_outputs: StructuredOutputs | None = None  # JSON schema / JSON object constraint

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise through object.__setattr__

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if type(self.max_tokens) is not int:
            set_(self, "max_tokens", int(self.max_tokens))

        if not _is_real(self.temperature) or not (0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (the sampler's float32 "
                f"bound), got {self.temperature!r}"
            )
        if type(self.temperature) is not float:
            set_(self, "temperature", float(self.temperature))

        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.top_p < MIN_TOP_P:
            raise ValueError(
                f"top_p must be at least {MIN_TOP_P:.8g} (smaller values round to 0 in float32, "
                f"the sampler's dtype, and mask every token), got {self.top_p!r}: use top_k 1 "
                "to keep only the most likely token"
            )
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
        self._validate_choices_and_penalties()
        # Read per row per step by the sampler: which rows change their logits first.
        set_(self, "uses_penalties", self._uses_penalties())
        set_(
            self,
            "processes_logits",
            self.uses_penalties or bool(self.logit_bias) or self.structured_outputs is not None,
        )
        # Penalties and grammars read every earlier token on the host (LLMEngine.step).
        set_(
            self,
            "needs_host_tokens",
            self.uses_penalties or self.structured_outputs is not None,
        )
        # Read per row per step by the runner: greedy rows without logprobs need no sampler.
        set_(
            self, "argmax_only", self.greedy and self.logprobs is None and not self.processes_logits
        )

    def _validate_choices_and_penalties(self) -> None:
        set_ = object.__setattr__
        if not _is_int(self.n) or not (1 <= self.n <= MAX_N):
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        set_(self, "n", int(self.n))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not (-MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(
                    f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
                )
            set_(self, name, float(value))
        rp = self.repetition_penalty
        if not _is_real(rp) or not (MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY):
            raise ValueError(
                f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 = off; beyond these bounds float32, the "
                f"sampler's dtype, turns logits into 0 or infinity), got {rp!r}"
            )
        set_(self, "repetition_penalty", float(rp))
        set_(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputs or None, got {type(so).__name__}"
            )

    def _uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

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


def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
    """{token id: bias} with int ids (JSON bodies spell them as strings: "50256") and float
    biases in [-100, 100]; None or empty -> None. Ids are checked against the vocabulary when
    the request is added (kvbatch.engine.core.llm_engine)."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id -> bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.isdecimal():
            token = int(key)
        if not _is_int(token) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        if not _is_real(value) or not (-MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ValueError(
                f"logit_bias[{key!r}] must be a number in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {value!r}"
            )
        out[int(token)] = float(value)
    return out or None

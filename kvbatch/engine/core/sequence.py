"""A request's state inside the engine."""

from __future__ import annotations

import enum
import sys
import time
from dataclasses import dataclass, field

from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.pooling.config import PoolingConfig
from kvbatch.engine.spec.stats import SpecDecodeStats
from kvbatch.engine.structured.constraint import TokenConstraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class ChoiceGroup:
    """The n sequences of one request with n > 1 (kvbatch.engine.core.choices): choice 0 is
    the request's own sequence; the others start once its prompt's KV is there to share."""

    seqs: list[Sequence]  # by choice index
    forked: bool = False  # the children have started (sharing choice 0's prompt blocks)
    num_unfinished: int = 0

    def __post_init__(self) -> None:
        self.num_unfinished = len(self.seqs)

    def finish_one(self) -> bool:
        """Count one choice finished; True when it was the last (the request is done)."""
        self.num_unfinished -= 1
        return self.num_unfinished == 0


@dataclass(eq=False)
class Sequence:
    """One request. `token_ids` is prompt + outputs; the KV of the first `num_computed_tokens`
    is in the cache (or is being written by the step that scheduled them).

    With async scheduling (engine/core/llm_engine.py) a sampled token reaches the host one step
    after the step that sampled it: until then it is *pending*, counted in `num_tokens` (so
    the scheduler runs it as this sequence's next decode) but not yet in `token_ids`, and the
    next step reads it on the device from row `pending_row` of the last launched step's
    sampled tokens."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache at first admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    output_text: str | None = None  # set when a stop string cut the text
    logprobs: list[TokenLogprobs] | None = None
    # Wall-clock timing (time.perf_counter): arrival, first and latest output token, and the
    # longest wait between two output tokens (what chunked prefill must keep short).
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None  # first admitted to run: ends its queue time
    first_token_time: float | None = None
    last_token_time: float | None = None
    max_token_gap: float = 0.0
    # Speculative decoding (engine/spec/). Drafts are proposed, unverified tokens that follow
    # token_ids: scheduled and scored with them, but never part of them until accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: object | None = None  # [k, vocab] tensor: the draft's q per draft; None = one-hot
    spec_stats: SpecDecodeStats | None = None  # set once the sequence has speculated
    spec_acceptance: float = 1.0  # EWMA of accepted / proposed, for switching speculation off
    spec_resume_step: int = 0  # engine step from which the sequence may speculate again
    num_pending: int = 0  # sampled on the device, not yet appended (async scheduling)
    # prompt + max_tokens, capped by the context (set by the scheduler): no token runs past it
    token_limit: int = sys.maxsize
    pending_row: int = -1  # the newest pending token's row in its step's sampled tokens
    choice_index: int = 0  # which of the request's n choices this is
    choices: ChoiceGroup | None = None  # the request's n choices, when n > 1
    grammar: TokenConstraint | None = None  # structured outputs: allowed tokens, step by step
    # Embedding requests (engine/pooling/): prefill only, never sampled; the pooled vector
    # ([hidden] float32 on the host) once the whole prompt has been computed.
    pooling: PoolingConfig | None = None
    embedding: object | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    def record_token_time(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.max_token_gap = max(self.max_token_gap, now - self.last_token_time)
        self.last_token_time = now

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None

    @property
    def num_tokens(self) -> int:
        """Tokens so far, pending ones included: what the scheduler plans with."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def takes_prefix_hits(self) -> bool:
        """Whether admission may skip cached prefix blocks: not for a pooling that reads every
        token's hidden state (the cache keeps KV, not hidden states)."""
        return self.pooling is None or not self.pooling.needs_every_token

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

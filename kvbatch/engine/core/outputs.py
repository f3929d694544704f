"""What the engine hands back: vLLM's shapes, so users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvbatch.engine.core.sequence import TokenLogprobs
from kvbatch.engine.spec.stats import SpecDecodeStats

__all__ = [
    "CompletionOutput",
    "EngineStats",
    "RequestMetrics",
    "RequestOutput",
    "SpecDecodeStats",
]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "error" (see RequestOutput.error)
    stop_reason: int | str | None = None  # the stop token id or stop string
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestMetrics:
    """Seconds, from the request's arrival (time.perf_counter clock)."""

    arrival_time: float
    time_to_first_token: float | None  # None when no token was produced
    time_per_output_token: float | None  # mean gap after the first token; None below 2 tokens
    max_token_gap: float  # the longest wait between two consecutive output tokens
    finished_time: float | None
    queue_time: float | None = None  # arrival -> first scheduled (waiting for room in the batch)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when this request alone failed (the others still ran)
    error_code: str | None = None  # with error: "context_length_exceeded" or None
    metrics: RequestMetrics | None = None
    spec_stats: SpecDecodeStats | None = None  # draft tokens proposed / accepted (speculation on)


@dataclass
class EngineStats:
    num_requests: int
    num_finished: int
    num_steps: int
    prompt_tokens: int  # prompt tokens of admitted requests
    computed_tokens: int  # tokens actually run through the model (prefill + decode + recompute)
    generation_tokens: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    kv_usage: float
    num_kv_blocks: int
    block_size: int
    weight_bytes: int = 0  # the model's weights as loaded (quantized ones at their own size)
    quantization: str | None = None  # the quantization method, None for a float model
    kv_cache_dtype: str = ""  # the pool's element dtype: the model's, or float8_e4m3fn
    num_running: int = 0  # sequences admitted and not finished (waiting ones not counted)
    # Speculative decoding: draft tokens proposed and accepted, and acceptance by position in
    # the draft (accepted / proposed at that position).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_by_position: list[float] = field(default_factory=list)

    @property
    def spec_acceptance_rate(self) -> float:
        if not self.spec_draft_tokens:
            return 0.0
        return self.spec_accepted_tokens / self.spec_draft_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.computed_tokens / self.num_steps if self.num_steps else 0.0

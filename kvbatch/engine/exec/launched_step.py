"""A step whose forward and sampling are queued on the device, and its tokens once on the host.

On CUDA, `launch` returns as soon as the kernels are queued; the sampled tokens (and any
logprobs) start their copy into pinned host memory at once, and an event marks the copy's end.
`result()` waits for that event only, so the host can queue the *next* step first (async
scheduling, engine/core/llm_engine.py) without `.tolist()` waiting for that next step as well: a
plain `.tolist()` on a CUDA tensor waits for everything queued on the stream.

A step may also be timed (`start_clock` before its work is queued, `seconds` once its
tokens are back), for the step cost model (engine/sched/step_cost.py). On CUDA the clock is a pair
of events on the stream, so with async scheduling a step's time is the device's: its start
event completes only when the step before has finished, not when the host queued it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvbatch.engine.core.sequence import Sequence
from kvbatch.engine.exec.sampler import SamplerOutput


@dataclass
class StepResult:
    """New tokens for the chunks that reached the end of their sequence, in step order: one
    each, or with speculation the accepted drafts and then one token of the target's own."""

    seqs: list[Sequence]
    token_ids: list[list[int]]
    # Per sampler row (rows follow token_ids flattened), when some row asked for logprobs:
    # the chosen token's logprob, the top ids and the top logprobs.
    logprobs: tuple[list[float], list[list[int]], list[list[float]]] | None = None
    # Embedding requests whose prompt ended in this step, and their vectors ([n, hidden]
    # float32 on the host, a row each).
    pooled_seqs: list[Sequence] = field(default_factory=list)
    pooled: torch.Tensor | None = None


class LaunchedStep:
    """Sampled tokens on their way to the host."""

    def __init__(
        self,
        seqs: list[Sequence],
        sampled: SamplerOutput | None,
        tokens: list[list[int]] | None = None,
        started: torch.cuda.Event | float | None = None,
    ) -> None:
        """`tokens`: already on the host (speculative verification), else one per row of
        `sampled.token_ids`. `started`: the step's start_clock, to time it."""
        self.seqs = seqs
        self._tokens = tokens
        self._tensors: list[torch.Tensor | None] = []
        self._event = None
        self._started = started
        self._seconds: float | None = None
        self.shape = None  # the scheduler's StepShape, when the engine times steps
        self.padded_chunk = 0  # the chunk bucket of the step's CUDA graph (0: none)
        self._pooled_seqs: list[Sequence] = []
        self._pooled: torch.Tensor | None = None
        if sampled is None:
            return
        tensors = [sampled.token_ids, sampled.logprobs, sampled.top_ids, sampled.top_logprobs]
        if tokens is not None:
            tensors[0] = None
        device = sampled.token_ids.device
        if device.type == "cuda":
            tensors = [None if t is None else _to_pinned(t) for t in tensors]
            self._event = torch.cuda.Event(enable_timing=started is not None)
            self._event.record(torch.cuda.current_stream(device))
        elif started is not None:  # the CPU ran the step while it was queued
            self._seconds = time.perf_counter() - started
        self._tensors = tensors

    def attach_pooled(self, seqs: list[Sequence], vectors: torch.Tensor) -> None:
        """Embedding requests that ended in this step and their vectors (on the device):
        copied to the host with the tokens, and waited for by `result()` alone."""
        self._pooled_seqs = seqs
        if vectors.device.type == "cuda":
            vectors = _to_pinned(vectors)
            self._event = torch.cuda.Event(enable_timing=self._started is not None)
            self._event.record(torch.cuda.current_stream(vectors.device))
        self._pooled = vectors

    @property
    def seconds(self) -> float | None:
        """The step's time, once `result()` has returned; None when it was not timed (or had
        no token to sample: nothing waits on such a step)."""
        if self._seconds is None and self._event is not None and self._started is not None:
            self._seconds = self._started.elapsed_time(self._event) / 1e3
        return self._seconds

    def result(self) -> StepResult:
        """Waits for this step's tokens (not for steps queued after it)."""
        if self._event is not None:
            self._event.synchronize()
        result = self._token_result()
        result.pooled_seqs, result.pooled = self._pooled_seqs, self._pooled
        return result

    def _token_result(self) -> StepResult:
        if not self._tensors:
            return StepResult(self.seqs, self._tokens or [])
        token_ids, chosen, top_ids, top_logprobs = self._tensors
        tokens = self._tokens
        if tokens is None:
            tokens = [[t] for t in token_ids.tolist()]
        logprobs = None
        if chosen is not None:
            logprobs = (chosen.tolist(), top_ids.tolist(), top_logprobs.tolist())
        return StepResult(self.seqs, tokens, logprobs)


def start_clock(device: torch.device) -> torch.cuda.Event | float:
    """A step's start: an event queued on the stream on CUDA, the host's clock on the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host

"""A deterministic stand-in for a continuously batching engine, for judging ETAs.

Requests are admitted first come first served, at most `concurrency` at once. A step runs every
admitted request's whole prompt (a new one) or one decode token (a running one), and takes
(tokens computed) / `tokens_per_second` on a fake clock. The counters follow the real engine's
meaning: a prompt step computes the prompt and yields the first output token, a decode step
feeds back the last token and yields the next, so a request of prompt P and output L costs
P + L - 1 computed tokens. Work is then exactly proportional to time, and the true time left is
known at every step: an estimate's error is the estimator's own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvbatch.engine.core.outputs import CompletionOutput, EngineStats, RequestOutput


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Running:
    index: int
    generated: int = 0


class SimulatedEngine:
    def __init__(
        self,
        prompts: Sequence[int],
        outputs: Sequence[int],
        concurrency: int,
        tokens_per_second: float,
        clock: FakeClock,
    ) -> None:
        assert len(prompts) == len(outputs) and min(outputs, default=1) >= 1
        self.prompts, self.outputs = prompts, outputs
        self.concurrency, self.rate, self.clock = concurrency, tokens_per_second, clock
        self.computed = self.generated = self.finished = 0
        self._next = 0
        self._running: list[_Running] = []

    @property
    def total_work(self) -> int:
        return sum(p + n - 1 for p, n in zip(self.prompts, self.outputs))

    def seconds_left(self) -> float:
        """The true time the rest of the job takes."""
        return (self.total_work - self.computed) / self.rate

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests=self._next,
            num_finished=self.finished,
            num_running=len(self._running),
            num_steps=0,
            prompt_tokens=sum(self.prompts[: self._next]),
            computed_tokens=self.computed,
            generation_tokens=self.generated,
            num_preemptions=0,
            prefix_queries=0,
            prefix_hits=0,
            kv_usage=0.0,
            num_kv_blocks=0,
            block_size=16,
        )

    def run(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding each as it finishes (after the
        step that finished it, the clock at that step's end)."""
        while self._running or self._next < len(self.prompts):
            while len(self._running) < self.concurrency and self._next < len(self.prompts):
                self._running.append(_Running(self._next))
                self._next += 1
            tokens = 0
            for r in self._running:
                tokens += self.prompts[r.index] if r.generated == 0 else 1
                r.generated += 1
            self.computed += tokens
            self.generated += len(self._running)
            self.clock.now += tokens / self.rate
            done = [r for r in self._running if r.generated == self.outputs[r.index]]
            self._running = [r for r in self._running if r not in done]
            for r in done:
                self.finished += 1
                yield RequestOutput(
                    request_id=str(r.index),
                    prompt=None,
                    prompt_token_ids=[],
                    outputs=[CompletionOutput(0, "", [0] * r.generated, "length")],
                    finished=True,
                )

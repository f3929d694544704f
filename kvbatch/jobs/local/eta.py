"""How long a running job has left: the engine work still expected, over the recent rate.

Why not ``(total - done) * elapsed / done``. Requests run concurrently (continuous batching,
up to ``max_num_seqs`` at once), so when the first one finishes the elapsed time is about one
request's whole latency, and dividing it by one finished request makes the first estimate
roughly the concurrency times too long (users saw a first ETA five times the whole job).

The model here counts work in the unit the engine runs: tokens through the model
(``EngineStats.computed_tokens``: prefill, decode and recompute). Before the job starts it knows

* the prompt work: all prompt tokens less what the prefix cache is expected to serve (the
  prefix grouping's ``ideal_cached_tokens``);
* each request's output cap (its ``max_tokens``, set per request by ``kvbatch run``) and its
  number of choices (``n``; an embedding generates nothing).

Output lengths are learned from the finished requests: every unfinished choice is expected to
generate the mean output of the finished choices, bounded by its own cap (and the outputs
expected in all are at least the tokens generated so far, in-flight requests' included,
should those have outrun the mean). A sequence feeds
every output token back except its last (the first comes from the prefill step), so the job's
expected work is::

    prompt tokens - cached + sum(expected outputs) - number of choices

and what is left is that less ``computed_tokens`` since the start, at least one token per
unfinished request. Dividing by the rate of computed tokens gives seconds. Since all requests
in flight progress together, the concurrency no longer inflates the estimate: the rate already
counts every running sequence's tokens.

The rate is measured over a recent window (``window_seconds``): from the start until the job
has run that long, afterwards from the last observation at least a window old. A start heavy
with prefill (cheap per token on a GPU) then does not speak for a decode-heavy end. Samples are
taken only when the estimator is asked, so the result depends only on the clock readings and
the counters it was given (tests drive it with a fake clock).

What it cannot know: until a request finishes there is no output length to go by, so no
estimate (``seconds_left`` returns None; Progress shows "ETA ?"), unless no request generates
at all (embeddings). The first requests to finish are the shortest of the cohort that was
running when the first one finished, so when output lengths vary the estimate is low until
that cohort has finished, and rises as longer answers come in: at the first finish nothing says
how much longer the others run, short of assuming a length distribution. Until then the
estimate is marked a lower bound (``settled`` is False; Progress shows "ETA >N s"). Counting every token alike also makes a prefill token cost what a decode token
does, while a decode step's fixed cost makes its tokens dearer: a start heavy with prefill
reads as a fast rate until the window has moved past it. Recompute
after a preemption counts as progress. The job's last stretch runs fewer sequences at once,
hence fewer tokens a second, than the recent window suggests.
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["EtaEstimator", "JobWork", "TokenCounts", "format_eta"]


class TokenCounts(Protocol):
    """The engine's counters the estimate reads (EngineStats has them)."""

    computed_tokens: int  # cumulative
    generation_tokens: int  # cumulative
    num_running: int  # sequences running now


class _Params(Protocol):
    max_tokens: int
    n: int


class _Request(Protocol):
    """A job request as far as its work goes (kvbatch.jobs.openai_format.validate.JobRequest)."""

    is_pooled: bool  # embeddings and scores: nothing generated
    params: _Params | None


@dataclass(frozen=True)
class JobWork:
    """What a job asks of the engine, known before it runs. ``max_tokens`` and ``choices`` are
    indexed by the engine request id (``kvbatch run`` makes it the request's index in the
    job); an embedding has 0 choices."""

    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, what the prefix cache is expected to serve
    max_tokens: Sequence[int]
    choices: Sequence[int]

    @classmethod
    def of(cls, requests: Iterable[_Request], prompt_tokens: int, cached_tokens: int) -> JobWork:
        caps, choices = array("q"), array("q")
        for r in requests:
            cap, n = cls.row(r)
            caps.append(cap)
            choices.append(n)
        return cls(prompt_tokens, cached_tokens, caps, choices)

    @staticmethod
    def row(r: _Request) -> tuple[int, int]:
        """(output cap, choices) of one request: (0, 0) for one that generates nothing."""
        generates = not r.is_pooled and r.params is not None
        return (r.params.max_tokens, r.params.n) if generates else (0, 0)

    def __post_init__(self) -> None:
        if len(self.max_tokens) != len(self.choices):
            raise ValueError("max_tokens and choices must have one entry per request")


class _CapSums:
    """Sum over the unfinished requests of ``choices * min(m, cap)`` for any m, in O(log caps):
    Fenwick trees over the distinct caps of choices and of choices * cap, so finishing one
    request and asking for a new mean both stay cheap in a job of millions of requests."""

    def __init__(self, caps: Sequence[int], choices: Sequence[int]) -> None:
        self.caps = sorted(set(caps))
        self.count = [0] * (len(self.caps) + 1)  # choices, by cap
        self.weight = [0] * (len(self.caps) + 1)  # choices * cap, by cap
        self.choices = 0
        for cap, n in zip(caps, choices):
            self.add(cap, n)

    def add(self, cap: int, n: int) -> None:
        if not n:
            return
        self.choices += n
        i = bisect_left(self.caps, cap) + 1
        while i < len(self.count):
            self.count[i] += n
            self.weight[i] += n * cap
            i += i & -i

    def capped_total(self, m: float) -> float:
        """sum of choices * min(m, cap)."""
        i = bisect_left(self.caps, m)  # caps[:i] are below m
        below_n = below_w = 0
        while i > 0:
            below_n += self.count[i]
            below_w += self.weight[i]
            i -= i & -i
        return below_w + m * (self.choices - below_n)


class EtaEstimator:
    """Seconds left in a job; see the module docstring for the model.

    Tell it every finished request (``finished``), then ask ``seconds_left`` with the engine's
    current counters. ``start`` is the engine's counters when the job began (an engine may
    have run other work before)."""

    def __init__(
        self,
        work: JobWork,
        start: TokenCounts,
        clock: Callable[[], float] = time.monotonic,
        window_seconds: float = 60.0,
    ) -> None:
        self.work, self.clock, self.window = work, clock, window_seconds
        self._computed0, self._generated0 = start.computed_tokens, start.generation_tokens
        self._unfinished = _CapSums(work.max_tokens, work.choices)
        self._left = len(work.max_tokens)  # requests not finished
        # The work besides the outputs: prompt tokens to compute, less one token a choice
        # (its last output token is never fed back).
        self._base_work = work.prompt_tokens - work.cached_tokens - self._unfinished.choices
        self._done_choices = self._done_output = 0
        self._done_requests = 0
        self._cohort: int | None = None  # requests finished once the first cohort is done
        self._samples: deque[tuple[float, int]] = deque([(clock(), 0)])

    def finished(self, request_id: str | int, output_tokens: int) -> None:
        """Request `request_id` finished, having generated `output_tokens` (all choices)."""
        try:
            i = int(request_id)
        except ValueError:
            return  # not one of the job's requests
        if not 0 <= i < len(self.work.max_tokens):
            return
        n = self.work.choices[i]
        self._unfinished.add(self.work.max_tokens[i], -n)
        self._left -= 1
        self._done_requests += 1
        self._done_choices += n
        self._done_output += output_tokens

    def seconds_left(self, now: TokenCounts) -> float | None:
        """The estimate, or None while it cannot be made (no output length known yet, or no
        work measured yet)."""
        if self._left <= 0:
            return 0.0
        if self._cohort is None and self._done_requests:
            # the sequences running at the first finish (this one included) started together
            self._cohort = self._done_requests + now.num_running
        computed = now.computed_tokens - self._computed0
        rate = self._rate(computed)
        output = self._expected_output()
        if rate is None or output is None:
            return None
        generated = now.generation_tokens - self._generated0  # in-flight requests' included
        total = self._base_work + max(output, generated)
        return max(total - computed, self._left) / rate

    @property
    def settled(self) -> bool:
        """Whether the output lengths seen so far speak for the job: the cohort running when
        the first request finished has finished (before, the estimate is a lower bound)."""
        if self._left <= 0 or self._unfinished.choices == 0:
            return True
        return self._cohort is not None and self._done_requests >= self._cohort

    def _expected_output(self) -> float | None:
        """All output tokens the job is expected to generate, finished requests' included."""
        if self._unfinished.choices == 0:
            return float(self._done_output)
        if self._done_choices == 0:
            return None
        mean = self._done_output / self._done_choices
        return self._done_output + self._unfinished.capped_total(mean)

    def _rate(self, computed: int) -> float | None:
        """Computed tokens a second over the recent window; records this observation."""
        now = self.clock()
        samples = self._samples
        samples.append((now, computed))
        while len(samples) > 2 and samples[1][0] <= now - self.window:
            samples.popleft()
        t0, c0 = samples[0]
        if now <= t0 or computed <= c0:
            return None
        return (computed - c0) / (now - t0)


def format_eta(seconds: float | None, lower_bound: bool = False) -> str:
    """The postfix's ETA: whole seconds ("ETA >N s" for a lower bound), or "?" while there is
    no estimate."""
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "ETA ?"
    if lower_bound:
        return "ETA ?" if seconds < 1 else f"ETA >{seconds:.0f} s"  # "more than 0 s": no news
    return f"ETA {seconds:.0f} s"

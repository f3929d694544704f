"""Progress of a running job: a bar on a terminal, periodic log lines otherwise.

The ETA comes from kvbatch.jobs.local.eta (expected engine work over the recent token rate), not
from requests done over time elapsed, which continuous batching makes about the concurrency
times too long at first. tqdm's own remaining-time field has that flaw, so the bar leaves it
out and shows ours in its postfix.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from kvbatch.jobs.local.eta import EtaEstimator, JobWork, format_eta

log = logging.getLogger("kvbatch.run")

# tqdm's default layout without its "<remaining" field
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


class Progress:
    """Counts a job's finished requests and shows how it is going.

    Without a terminal it logs a line once the first ETA can be estimated (when the first
    request finishes), then at most every `every_seconds`."""

    def __init__(
        self,
        engine,
        work: JobWork,
        every_seconds: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        bar: bool | None = None,  # None: when stderr is a terminal
        embeddings: bool = False,  # an embeddings job: counts inputs, generates no tokens
    ) -> None:
        self.embeddings = embeddings
        self.engine, self.every, self.clock = engine, every_seconds, clock
        self.total = len(work.max_tokens)
        self.done = self.tokens = 0
        self.start = self._last_log = clock()
        self.eta = EtaEstimator(work, engine.stats(), clock)
        self._logged_an_eta = False
        self.bar = None
        if sys.stderr.isatty() if bar is None else bar:
            self.bar = tqdm(
                total=self.total,
                unit="input" if embeddings else "req",
                desc="kvbatch run",
                file=sys.stderr,
                bar_format=_BAR_FORMAT,
            )

    def update(self, out, request: int | None = None) -> None:
        """`out` finished: `request` is its position in the job's work (default: its id)."""
        self.done += 1
        outputs = getattr(out, "outputs", None)  # an embedding generates no tokens
        generated = sum(len(c.token_ids) for c in outputs or ())
        self.tokens += generated
        self.eta.finished(out.request_id if request is None else request, generated)
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix(), refresh=False)
            self.bar.update(1)
            return
        due = self.clock() - self._last_log >= self.every
        if not due and self._logged_an_eta:
            return
        stats = self.engine.stats()
        seconds = self.eta.seconds_left(stats)
        if due or seconds is not None:
            self._last_log = self.clock()
            self._logged_an_eta |= seconds is not None
            what = "inputs" if self.embeddings else "requests"
            log.info("%d/%d %s, %s", self.done, self.total, what, self._postfix(stats, seconds))

    def postfix(self) -> str:
        """What the bar shows after the count, e.g. "12.5 tok/s, prefix hit 40%, ETA 95 s"."""
        stats = self.engine.stats()
        return self._postfix(stats, self.eta.seconds_left(stats))

    def _postfix(self, stats, seconds: float | None) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        if self.embeddings:  # no output tokens, and inputs rarely share a prefix
            eta = format_eta(seconds, lower_bound=not self.eta.settled)
            return f"{self.done / elapsed:.1f} inputs/s, {eta}"
        return (
            f"{self.tokens / elapsed:.1f} tok/s, prefix hit {stats.prefix_hit_rate:.0%}, "
            f"{format_eta(seconds, lower_bound=not self.eta.settled)}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elapsed = self.clock() - self.start
        if self.embeddings:
            log.info("embedded %d inputs in %.1f s", self.done, elapsed)
            return
        log.info("ran %d requests, %d output tokens in %.1f s", self.done, self.tokens, elapsed)

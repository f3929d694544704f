"""Progress of a running job: a bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("kvbatch.run")


class Progress:
    def __init__(self, total: int, engine, every_seconds: float = 10.0) -> None:
        self.total, self.engine, self.every = total, engine, every_seconds
        self.done = self.tokens = 0
        self.start = self._last_log = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", desc="kvbatch run", file=sys.stderr)

    def update(self, out) -> None:
        self.done += 1
        outputs = getattr(out, "outputs", None)  # an embedding generates no tokens
        self.tokens += sum(len(c.token_ids) for c in outputs or ())
        if self.bar is not None:
            self.bar.set_postfix_str(self._postfix(), refresh=False)
            self.bar.update(1)
        elif time.monotonic() - self._last_log >= self.every:
            self._last_log = time.monotonic()
            log.info("%d/%d requests, %s", self.done, self.total, self._postfix())

    def _postfix(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        stats = self.engine.stats()
        eta = (self.total - self.done) * elapsed / self.done if self.done else float("nan")
        return (
            f"{self.tokens / elapsed:.1f} tok/s, prefix hit {stats.prefix_hit_rate:.0%}, "
            f"ETA {eta:.0f} s"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elapsed = time.monotonic() - self.start
        log.info("ran %d requests, %d output tokens in %.1f s", self.done, self.tokens, elapsed)

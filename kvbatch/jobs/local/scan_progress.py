"""The progress line of a job's tokenizing pass (`kvbatch submit`, `kvbatch run`): a million
lines take minutes before the first shard is sent or the first answer made."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


class ScanProgress:
    """`kvbatch submit: tokenized 120,000 lines (12% of 1.7 GB), 2,310 lines/s, about 6 min
    left` on stderr every `every_seconds`, and once at the end (the ETA from the bytes read;
    none when the input's size is unknown). `command` names who speaks (`kvbatch run`)."""

    def __init__(
        self,
        total_bytes: int | None,
        every_seconds: float = 10.0,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        command: str = "kvbatch submit",
    ) -> None:
        self.command = command
        self.total = total_bytes
        self.every = every_seconds
        self.write = write or (lambda m: print(m, file=sys.stderr, flush=True))
        self.clock = clock
        self.start = self.last = clock()
        self.lines = 0

    def update(self, lines: int, bytes_read: int) -> None:
        self.lines = lines
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.write(self.line(bytes_read, now))

    def line(self, bytes_read: int, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        text = f"{self.command}: tokenized {self.lines:,} lines"
        if self.total:
            text += f" ({100 * bytes_read / self.total:.0f}% of {_size(self.total)})"
        text += f", {self.lines / elapsed:,.0f} lines/s"
        if self.total and bytes_read:
            left = elapsed * (self.total - bytes_read) / bytes_read
            text += f", about {_duration(left)} left"
        return text

    def done(self, bytes_read: int) -> None:
        now = self.clock()
        if now - self.start >= self.every:  # a job that took a while says how it ended
            took = _duration(now - self.start)
            self.write(self.line(bytes_read, now).split(", about")[0] + f", done in {took}")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"

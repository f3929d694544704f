"""The cycle collector's pauses during a benchmark run, from CPython's `gc.callbacks`.

A full (generation-2) pass examines every tracked object that is not frozen and holds the
host meanwhile; on a GPU whose decode step is a millisecond or two, one pass shows as a token
gap many steps long (engine/core/startup_heap.py). Recording each pass's start, end and generation
lets a run say whether its longest gap was a collection: the long-prefill figures name the
longest pause inside the prefill window, the step profile counts the run's passes.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple


class GCPause(NamedTuple):
    start: float  # time.perf_counter()
    end: float
    generation: int  # the oldest generation the pass examined (2: a full pass)

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _watch(owner: GCPauses) -> Callable[[str, dict[str, Any]], None]:
    """A gc callback that holds its owner weakly: a watcher that was never stopped does not
    live on in `gc.callbacks` (its callback stays, doing nothing)."""
    ref = weakref.ref(owner)
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            started[:] = [now]
        elif started and (watcher := ref()) is not None:
            watcher.pauses.append(GCPause(started.pop(), now, int(info["generation"])))

    return callback


class GCPauses:
    """Records the collector's passes from `start()` to `stop()` (or while used as a `with`)."""

    def __init__(self) -> None:
        self.pauses: list[GCPause] = []
        self._callback: Callable[[str, dict[str, Any]], None] | None = None

    def start(self) -> GCPauses:
        if self._callback is None:
            self._callback = _watch(self)
            gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        if self._callback is not None:
            gc.callbacks.remove(self._callback)
            self._callback = None

    def __enter__(self) -> GCPauses:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def clear(self) -> None:
        self.pauses.clear()

    def longest(self, start: float = float("-inf"), end: float = float("inf")) -> float | None:
        """Seconds of the longest pause that overlaps [start, end] (None: there was none)."""
        inside = [p.seconds for p in self.pauses if p.end > start and p.start < end]
        return max(inside, default=None)

    def summary(self) -> dict[str, Any]:
        """Passes per generation, the full passes' count and the longest pause of any pass."""
        per_generation = [sum(p.generation == g for p in self.pauses) for g in range(3)]
        full = [p.seconds for p in self.pauses if p.generation == 2]
        return {
            "collections": per_generation,  # [generation 0, 1, 2]
            "full_passes": per_generation[2],
            "longest_pause_s": self.longest(),
            "longest_full_pass_s": max(full, default=None),
            "pause_seconds": sum(p.seconds for p in self.pauses),
        }


def format_gc_pauses(summary: dict[str, Any]) -> str:
    """One phrase for the reports: 'GC: 12/1/0 passes (gen 0/1/2), longest 0.05 ms'."""
    counts = "/".join(str(n) for n in summary["collections"])
    longest = summary.get("longest_pause_s")
    tail = "" if longest is None else f", longest {longest * 1e3:.2f} ms"
    return f"GC: {counts} passes (gen 0/1/2){tail}"

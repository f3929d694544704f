"""Keep the cycle collector's full passes out of the run: freeze the heap an engine starts with.

CPython's cycle collector now and then examines every tracked object (a generation-2 pass),
triggered by allocation counts wherever a step happens to allocate. What an engine starts with
is a large, long-lived heap: torch's and transformers' modules, the model's modules and
parameters, one `Block` per KV block (engine/kv/block_pool.py; a 1B model on a large GPU has
hundreds of thousands). A full pass over such a heap takes tens to hundreds of milliseconds,
while a GPU decode step takes one or two: one pass is a stall of ten steps or more for every
running request, the kind of outlier that can set the long-prefill benchmark's longest token
gap (bench/gc_pauses.py records the passes, so a run can tell; docs/BENCHMARKS.md has
the figures).

`gc.freeze()` moves every object alive now into a permanent generation that no pass examines
(a full pass over what is created later stays short); reference counting still frees them.
vLLM's engine core does the same once it has started. The cost: a *cycle* among frozen
objects is never collected. Engines sit in reference cycles (runner <-> backend, CUDA graph
closures), so a dropped engine would keep its KV pool, nearly all of a GPU's memory, for the
life of the process. So a new engine first thaws what an earlier engine froze and collects,
before it loads weights or sizes its KV pool, and freezes again once it has started. The
heap is thawed at exit too (without the collection): objects still frozen when the
interpreter shuts down are never finalized, and extension modules report them (Triton's
nanobind prints "leaked ..." lines).
"""

from __future__ import annotations

import atexit
import gc

_frozen_by_an_engine = False


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns how many the freeze holds."""
    global _frozen_by_an_engine
    gc.collect()
    gc.freeze()
    if not _frozen_by_an_engine:
        atexit.register(_thaw_at_exit)  # once per freeze; a thaw unregisters it
    _frozen_by_an_engine = True
    return gc.get_freeze_count()


def thaw_startup_heap(collect: bool = True) -> None:
    """Undo an earlier engine's freeze and (by default) collect, freeing an engine dropped in
    a reference cycle, and the GPU memory it holds, now. Without such a freeze nothing
    happens: an application's own `gc.freeze()` is left alone (after an engine's, it thaws
    too: CPython has a single permanent generation)."""
    global _frozen_by_an_engine
    if _frozen_by_an_engine:
        gc.unfreeze()
        atexit.unregister(_thaw_at_exit)
        _frozen_by_an_engine = False
        if collect:
            gc.collect()


def _thaw_at_exit() -> None:
    thaw_startup_heap(collect=False)

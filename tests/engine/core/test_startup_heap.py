"""The startup freeze (engine/startup_heap.py): an engine's heap leaves the collector's full
passes, and the next engine thaws it so a dropped engine's cycles can still be collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvbatch.engine import LLM
from kvbatch.engine.core.startup_heap import thaw_startup_heap


@pytest.fixture(autouse=True)
def thawed_after():
    """No test leaves the rest of the suite with a frozen heap (its cycles would never go)."""
    yield
    thaw_startup_heap()
    gc.unfreeze()


def tracked(obj: object) -> bool:
    """Whether a collector's pass would examine obj (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_a_freezing_engine_takes_its_kv_blocks_out_of_the_collectors_passes(tiny_models):
    llm = LLM(str(tiny_models("llama-gqa")), freeze_gc=True)
    engine = llm.engine
    block = engine.kv._blocks[0]
    assert engine.frozen_gc_objects > len(engine.kv._blocks)  # the model and more besides
    assert gc.get_freeze_count() > len(engine.kv._blocks)  # less what refcounts freed since
    assert not tracked(block) and not tracked(engine)
    created_later = [object()]  # what the run allocates is collected as usual
    assert tracked(created_later)


def test_the_cpu_default_leaves_the_heap_alone(tiny_models):
    llm = LLM(str(tiny_models("llama-gqa")))  # freeze_gc=None: on CUDA only
    assert llm.engine.frozen_gc_objects == 0
    assert tracked(llm.engine.kv._blocks[0]) and tracked(llm.engine)


def test_the_next_engine_thaws_so_a_dropped_engine_in_a_cycle_is_collected(tiny_models):
    path = str(tiny_models("llama-gqa"))
    first = LLM(path, freeze_gc=True).engine
    first.cycle = first  # dropped engines sit in reference cycles (runner <-> backend, graphs)
    dropped = weakref.ref(first)
    del first
    gc.collect()
    assert dropped() is not None  # frozen: no pass examines the cycle
    LLM(path, freeze_gc=False)  # its start thaws the first engine's freeze, and collects
    assert dropped() is None


def test_an_applications_own_freeze_is_left_alone(tiny_models):
    path = str(tiny_models("llama-gqa"))
    LLM(path, freeze_gc=True)
    LLM(path, freeze_gc=False)  # thaws the engine's freeze: none by an engine remains
    gc.freeze()  # the application's own (e.g. a prefork parent's, before forking)
    frozen = gc.get_freeze_count()
    assert frozen > 0
    LLM(path, freeze_gc=False)
    # still frozen (an unfreeze empties the permanent generation); reference counting may
    # free a few frozen objects meanwhile, so not necessarily all of them (CI once: 2 fewer)
    assert gc.get_freeze_count() > 0.9 * frozen

"""GCPauses records the cycle collector's passes from gc.callbacks."""

from __future__ import annotations

import gc
import time
import weakref

from kvbatch.bench.gc_pauses import GCPauses, format_gc_pauses


def test_a_forced_full_pass_is_recorded_with_its_window():
    before = time.perf_counter()
    with GCPauses() as pauses:
        gc.collect()
    after = time.perf_counter()
    full = [p for p in pauses.pauses if p.generation == 2]
    assert len(full) >= 1 and before <= full[-1].start <= full[-1].end <= after
    summary = pauses.summary()
    assert summary["full_passes"] == len(full) and len(summary["collections"]) == 3
    assert summary["longest_full_pass_s"] == max(p.seconds for p in full)
    assert pauses.longest(before, after) == summary["longest_pause_s"] >= 0
    assert pauses.longest(after + 1, after + 2) is None  # no pause in a later window
    assert format_gc_pauses(summary).startswith(
        f"GC: {'/'.join(map(str, summary['collections']))} passes (gen 0/1/2), longest "
    )
    pauses.clear()
    assert pauses.summary()["collections"] == [0, 0, 0]
    assert format_gc_pauses(pauses.summary()) == "GC: 0/0/0 passes (gen 0/1/2)"


def test_a_stopped_watcher_records_nothing_more():
    pauses = GCPauses().start()
    callbacks = len(gc.callbacks)
    pauses.stop()
    assert len(gc.callbacks) == callbacks - 1
    gc.collect()
    assert pauses.pauses == []


def test_a_watcher_never_stopped_is_not_kept_alive_by_its_callback():
    pauses = GCPauses().start()
    dropped = weakref.ref(pauses)
    del pauses
    gc.collect()
    assert dropped() is None
    gc.collect()  # its callback, left in gc.callbacks, does nothing

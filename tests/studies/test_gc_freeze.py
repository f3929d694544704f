"""`python -m studies gc-freeze` on a few decoders: the same run with the startup heap in the
collector's passes and frozen, and a full pass over KV blocks alone."""

from __future__ import annotations

import gc
import json

from studies.gc_freeze import measure
from studies.registry import run


def test_the_frozen_run_leaves_its_startup_heap_out_and_the_process_thawed():
    r = measure(decoders=4, output_len=6, kv_blocks=500)
    passes, frozen = r["runs"]
    assert not passes["freeze_gc"] and frozen["freeze_gc"]
    assert passes["frozen_objects"] == 0 and frozen["frozen_objects"] > 0
    # the frozen engine's heap is in no generation: what a pass examines shrinks by it
    assert frozen["tracked_objects"] < passes["tracked_objects"] - frozen["frozen_objects"] // 2
    assert passes["steps"] == frozen["steps"] >= 6  # the same job
    assert len(frozen["gc"]["collections"]) == 3
    assert r["kv_blocks_full_pass_ms"] >= 0
    assert gc.get_freeze_count() == 0  # neither run leaves the process frozen


def test_cli_prints_both_rows_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gc.json"
    argv = ["gc-freeze", "--decoders", "2", "--output-len", "3", "--json", str(out)]
    assert run(argv) == 0
    printed = capsys.readouterr().out
    assert "| in the passes |" in printed and "| frozen |" in printed
    assert "KV blocks alone" not in printed  # --kv-blocks 0: not timed
    assert [run["freeze_gc"] for run in json.loads(out.read_text())["runs"]] == [False, True]

"""kvbatch.jobs.distributed.sorted_runs: the external sort finalize merges answers with."""

from __future__ import annotations

import random

import pytest

from kvbatch.jobs.distributed.sorted_runs import SortedRuns


def test_many_runs_merge_in_key_order(tmp_path):
    rng = random.Random(0)
    keys = list(range(5000))
    rng.shuffle(keys)
    with SortedRuns(tmp_path, run_bytes=4096) as runs:
        for k in keys:
            runs.add(k, b'{"index": %d, "text": "%s"}\n' % (k, b"x" * rng.randrange(40)))
        assert len(runs._runs) > 50  # spilled: the sort is external, not one list
        got = list(runs.merged())
    assert [k for k, _ in got] == sorted(keys)
    assert all(line.startswith(b'{"index": %d,' % k) and line.endswith(b"\n") for k, line in got)
    assert runs.count == 5000
    assert not list(tmp_path.iterdir())  # the run files are gone


def test_fits_in_memory_and_adds_the_missing_newline(tmp_path):
    with SortedRuns(tmp_path) as runs:
        runs.add(3, b"c")
        runs.add(1, b"a\n")
        assert list(runs.merged()) == [(1, b"a\n"), (3, b"c\n")]
        assert runs._runs == []
    with SortedRuns(tmp_path) as runs, pytest.raises(ValueError):
        runs.add(-1, b"x\n")

"""kvbatch.jobs.distributed.job_lines: the progress line submit shows while it tokenizes."""

from __future__ import annotations

from kvbatch.jobs.distributed.job_lines import ScanProgress


def test_progress_every_interval_with_an_eta_from_the_bytes_read():
    now = [0.0]
    shown: list[str] = []
    progress = ScanProgress(2_000_000_000, every_seconds=10, write=shown.append,
                            clock=lambda: now[0])  # fmt: skip
    progress.update(1_000, 1_000_000)
    assert shown == []  # not before the interval
    now[0] = 20.0
    progress.update(100_000, 200_000_000)  # 10% in 20 s: 180 s left
    assert shown == [
        "kvbatch submit: tokenized 100,000 lines (10% of 2.0 GB), 5,000 lines/s, about 3 min left"
    ]
    now[0] = 200.0
    progress.lines = 1_000_000
    progress.done(2_000_000_000)
    assert shown[-1] == (
        "kvbatch submit: tokenized 1,000,000 lines (100% of 2.0 GB), 5,000 lines/s, done in 3 min"
    )


def test_a_quick_job_says_nothing():
    shown: list[str] = []
    progress = ScanProgress(1000, write=shown.append, clock=lambda: 1.0)
    progress.update(10, 500)
    progress.done(1000)
    assert shown == []

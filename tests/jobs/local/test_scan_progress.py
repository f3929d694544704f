"""kvbatch.jobs.local.scan_progress: the progress line submit and run show while they tokenize."""

from __future__ import annotations

from pathlib import Path

from kvbatch.bench.submit_workload import write_chat_job
from kvbatch.jobs.local.digest_index import DigestIndex
from kvbatch.jobs.local.model_on_demand import ModelOnDemand
from kvbatch.jobs.local.options import RunOptions
from kvbatch.jobs.local.prepare import prepare_lines
from kvbatch.jobs.local.scan_progress import ScanProgress
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.storage import LocalStorage


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


def test_the_run_pass_shows_its_progress(tmp_path: Path, tiny_chat_model: Path):
    src = write_chat_job(tmp_path / "in.jsonl", 600, words=10, bad_lines={600: b"{"})
    opts = RunOptions(input=str(src), model=str(tiny_chat_model), tokenize_workers=1)
    shown: list[str] = []
    clock = iter(range(0, 10_000, 5))  # 5 s between readings
    progress = ScanProgress(src.stat().st_size, every_seconds=9, write=shown.append,
                            clock=lambda: float(next(clock)), command="kvbatch run")  # fmt: skip
    with TokenStore(tmp_path) as store:
        job = prepare_lines(LocalStorage(str(src)), opts, ModelOnDemand(opts), store,
                            DigestIndex(), progress)  # fmt: skip
        job.close()
    assert [m.split(" (")[0] for m in shown] == [
        "kvbatch run: tokenized 512 lines",
        "kvbatch run: tokenized 600 lines",
    ]
    assert "(100% of" not in shown[0] and "about" in shown[0]
    assert shown[-1].endswith("lines/s, done in 15 s")

"""kvbatch.jobs.local.progress: what a running job shows. Log lines (no terminal) against the
simulated engine, then through `kvbatch run`'s own machinery on the tiny chat model."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from kvbatch.jobs.local.eta import JobWork
from kvbatch.jobs.local.progress import Progress
from kvbatch.jobs.local.run import RunOptions, run_job
from tests.jobs.local.test_run import WORDS, chat, plant_partial, read_jsonl, write_jsonl
from tests.jobs.simulated_engine import FakeClock, SimulatedEngine

MiB = 1024 * 1024
PROGRESS_LINE = re.compile(r"^(\d+)/(\d+) requests, [\d.]+ tok/s, prefix hit \d+%, ETA (.+)$")


def progress_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, int, str]]:
    found = []
    for record in caplog.records:
        m = PROGRESS_LINE.match(record.getMessage())
        if m:
            found.append((int(m[1]), int(m[2]), m[3]))
    return found


def seconds(eta: str) -> float:
    """ "95 s" -> 95.0; fails on "?", "nan" and the like."""
    m = re.fullmatch(r"(\d+) s", eta)
    assert m, f"not a number of seconds: ETA {eta}"
    return float(m[1])


def test_logs_the_first_eta_at_the_first_finish_then_every_interval(caplog):
    clock = FakeClock()
    n = 64
    engine = SimulatedEngine([100] * n, [50] * n, 8, 1000.0, clock)
    work = JobWork(100 * n, 0, [64] * n, [1] * n)
    progress = Progress(engine, work, every_seconds=2.0, clock=clock, bar=False)
    assert progress.postfix().endswith("ETA ?")  # nothing finished: no estimate, no "nan"
    logged_at = []
    with caplog.at_level(logging.INFO, logger="kvbatch.run"):
        for out in engine.run():
            before = len(caplog.records)
            progress.update(out)
            if len(caplog.records) > before:
                logged_at.append((clock.now, engine.seconds_left()))
        progress.close()
    lines = progress_lines(caplog)
    assert lines[0][:2] == (1, n)  # the first finish, not ten seconds in
    first_time, first_true = logged_at[0]
    assert seconds(lines[0][2]) == pytest.approx(first_true, abs=0.5)
    times = [t for t, _ in logged_at]
    assert all(b - a >= 2.0 for a, b in zip(times, times[1:]))
    assert len(lines) >= 3
    assert caplog.records[-1].getMessage().startswith(f"ran {n} requests, {50 * n} output tokens")


def test_the_postfix(caplog):
    clock = FakeClock()
    engine = SimulatedEngine([10, 10], [5, 5], 1, 10.0, clock)
    progress = Progress(engine, JobWork(20, 0, [5, 5], [1, 1]), clock=clock, bar=False)
    outputs = engine.run()
    progress.update(next(outputs))  # request 0: 10 + 4 tokens in 1.4 s; 14 left at 10 tok/s
    assert progress.postfix() == "3.6 tok/s, prefix hit 0%, ETA 1 s"
    progress.update(next(outputs))
    assert progress.postfix().endswith("ETA 0 s")


def test_a_job_with_no_requests_shows_no_nan(caplog):
    clock = FakeClock()
    engine = SimulatedEngine([], [], 4, 1000.0, clock)
    progress = Progress(engine, JobWork(0, 0, [], []), clock=clock, bar=False)
    assert progress.postfix() == "0.0 tok/s, prefix hit 0%, ETA 0 s"
    with caplog.at_level(logging.INFO, logger="kvbatch.run"):
        progress.close()
    assert caplog.records[-1].getMessage() == "ran 0 requests, 0 output tokens in 0.0 s"


def test_the_bar_leaves_out_tqdms_own_remaining_time(capsys):
    clock = FakeClock()
    engine = SimulatedEngine([10] * 4, [5] * 4, 2, 10.0, clock)
    progress = Progress(engine, JobWork(40, 0, [5] * 4, [1] * 4), clock=clock, bar=True)
    for out in engine.run():
        progress.update(out)
    progress.close()
    shown = capsys.readouterr().err
    assert "4/4" in shown and "ETA 0 s" in shown
    assert "<" not in shown and "?" not in shown.rpartition("\r")[2]


# -- through `kvbatch run` -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_chat_model: Path):
    from kvbatch.engine import LLM

    # few sequences at once, so the first finish leaves most of the job to run
    return LLM(
        model=str(tiny_chat_model),
        device="cpu",
        max_model_len=256,
        max_num_seqs=4,
        block_size=16,
        kv_cache_bytes=16 * MiB,
    )


def test_a_run_logs_a_finite_eta_once_a_request_finished(llm, tmp_path: Path, caplog):
    lines = [chat(f"r{i}", " ".join(WORDS[: 3 + i % 9]) + f" {i}") for i in range(24)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="unused", output=str(tmp_path / "out.jsonl"))
    with caplog.at_level(logging.INFO, logger="kvbatch.run"):
        run_job(opts, llm=llm)
    shown = progress_lines(caplog)
    assert shown and shown[0][0] >= 1 and shown[0][1] == len(lines)
    assert all(seconds(eta) >= 0 for _, _, eta in shown)
    assert "nan" not in caplog.text


def test_a_resumed_run_with_everything_answered_shows_no_nan(llm, tmp_path: Path, caplog):
    lines = [chat(f"r{i}", f"{WORDS[i]} {i}") for i in range(6)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="unused", output=str(tmp_path / "out.jsonl"))
    run_job(opts, llm=llm)
    answers = read_jsonl(tmp_path / "out.jsonl")
    opts.resume = True
    plant_partial(opts, lines, answers)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvbatch.run"):
        record = run_job(opts, llm=llm)
    assert record.completed == len(lines)
    assert "no line to run (6 answered by an earlier run, 0 refused)" in caplog.text
    assert "nan" not in caplog.text
    assert json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])["custom_id"] == "r0"

"""Progress inside a running shard: the worker's ProgressWriter writes how many of the
shard's requests are done, and job_status counts them (with tokens/s and an ETA) before the
shard's result exists, and not again once it does. Real engine, real job folder."""

from __future__ import annotations

import logging
from pathlib import Path

from kvbatch.jobs.distributed.finalize import (
    job_status,
    read_manifest,
    record_attempt,
    write_shard_result,
)
from kvbatch.jobs.distributed.shard_progress import ProgressWriter, progress_key
from kvbatch.jobs.distributed.shards import job_dir, read_shard, run_shard
from kvbatch.worker.cli import format_status
from tests.jobs.distributed.test_finalize import make_llm  # noqa: F401
from tests.jobs.distributed.test_submit import prepare, rag_lines


def _run(llm, job, msg, should_stop):
    manifest = read_manifest(job)
    return run_shard(
        llm,
        msg,
        model_name=manifest["model_name"],
        batch_id=manifest["batch_id"],
        created=manifest["created_at"],
        should_stop=should_stop,
    )


def test_status_counts_a_running_shard_then_its_result_once(
    tmp_path: Path,
    make_llm,  # noqa: F811
    tiny_chat_model,
):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    first = sub.messages[0]
    size = len(read_shard(first))
    before = job_status(job)
    assert before["running_finished"] == 0 and before["eta_s"] is None

    llm = make_llm()
    llm.generate(["warm the engine up"], use_tqdm=False)  # the worker's engine has a past
    record_attempt(job, first.shard_id, 3)  # as the worker does: the job's clock starts
    writer = ProgressWriter(job, first.shard_id, llm, lambda: False, every=0.0)
    records = _run(llm, job, first, writer)
    writer.write()  # the state after the last step (the worker's next write would say so)
    running = job_status(job)
    assert running["running_finished"] == size  # this shard's requests only, not the warm-up
    assert running["completed"] == 0 and running["shards_done"] == 0
    assert running["output_tokens"] > 0 and running["eta_s"] is not None
    assert f"{size} / {running['requests']} done ({size} in running shards" in format_status(
        running
    )

    assert write_shard_result(job, first.shard_id, records)
    written = job_status(job)
    assert written["running_finished"] == 0  # the result replaces the progress
    assert written["completed"] + written["failed"] == size


def test_unwritable_progress_never_stops_the_shard(
    tmp_path: Path,
    make_llm,  # noqa: F811
    tiny_chat_model,
    caplog,
):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    folder, _ = progress_key(sub.messages[0].shard_id)
    (tmp_path / "out" / sub.job_id / folder).write_text("a file where the folder should be")
    llm = make_llm()
    writer = ProgressWriter(job, sub.messages[0].shard_id, llm, every=0.0)
    with caplog.at_level(logging.WARNING, logger="kvbatch.jobs.distributed.shard_progress"):
        records = _run(llm, job, sub.messages[0], writer)
    assert len(records) == len(read_shard(sub.messages[0]))
    assert "cannot write progress" in caplog.text
    assert job_status(job)["running_finished"] == 0

"""The distributed path end to end, in process: prepare_job, run_shard per shard on a tiny
engine, write_shard_result, try_finalize; compared with `kvbatch run` on the same input.
Also duplicate deliveries, a lost or doubled finalizer, poison shards, and an S3 round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbatch.jobs.distributed import finalize
from kvbatch.jobs.distributed.finalize import (
    fail_shard,
    job_status,
    read_manifest,
    record_attempt,
    try_finalize,
    write_shard_result,
)
from kvbatch.jobs.distributed.shards import job_dir, run_shard
from kvbatch.jobs.local.run import RunOptions, resolve_paths, run_job
from kvbatch.jobs.storage import open_storage
from tests.jobs.distributed.test_submit import BLOCK_SIZE, MAX_MODEL_LEN, prepare, rag_lines
from tests.jobs.local.test_run import read_jsonl, write_jsonl
from tests.s3_server import S3Server

MiB = 1024 * 1024


@pytest.fixture
def make_llm(tiny_chat_model: Path):
    """A fresh engine each call: cached-token counts then depend only on the job's order."""
    from kvbatch.engine import LLM

    def make():
        return LLM(
            model=str(tiny_chat_model),
            device="cpu",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=64,
            block_size=BLOCK_SIZE,
            kv_cache_bytes=64 * MiB,
        )

    return make


def run_shards(llm, job, messages) -> None:
    manifest = read_manifest(job)
    for msg in messages:
        records = run_shard(
            llm,
            msg,
            model_name=manifest["model_name"],
            batch_id=manifest["batch_id"],
            created=manifest["created_at"],
        )
        assert write_shard_result(job, msg.shard_id, records)


def comparable(line: dict) -> tuple:
    if line["error"] is not None:
        return (line["custom_id"], line["error"]["code"], line["error"]["line"])
    body = line["response"]["body"]
    choice = body["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return (line["custom_id"], body["object"], text, choice["finish_reason"], body["usage"])


def test_distributed_job_matches_kvbatch_run(
    tmp_path: Path, make_llm, tiny_chat_model: Path, monkeypatch
):
    lines = rag_lines()
    opts = RunOptions(input=str(write_jsonl(tmp_path / "ref.jsonl", lines)), model="unused")
    ref_record = run_job(opts, llm=make_llm())
    paths = resolve_paths(opts)
    ref_out, ref_err = read_jsonl(Path(paths.output)), read_jsonl(Path(paths.errors))
    ref_batch = json.loads(Path(paths.batch).read_text())

    sub = prepare(tmp_path, tiny_chat_model, lines, shard_tokens=400)
    assert len(sub.messages) >= 3
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    llm = make_llm()
    run_shards(llm, job, sub.messages[:-1])
    assert try_finalize(job) is None  # a shard is missing
    assert not job.join("output.jsonl").exists()
    status = job_status(job)
    assert status["status"] == "in_progress"
    assert (status["shards_done"], status["shards_total"]) == (
        len(sub.messages) - 1,
        len(sub.messages),
    )
    run_shards(llm, job, sub.messages[-1:])

    record = try_finalize(job)
    assert record is not None and record.status == "completed"
    folder = Path(sub.dir_uri)
    out, err = read_jsonl(folder / "output.jsonl"), read_jsonl(folder / "errors.jsonl")
    assert [comparable(x) for x in out] == [comparable(x) for x in ref_out]
    assert [comparable(x) for x in err] == [comparable(x) for x in ref_err]
    batch = json.loads((folder / "batch.json").read_text())
    assert batch["status"] == "completed" and batch["id"] == record.id != ref_record.id
    assert batch["request_counts"] == ref_batch["request_counts"]
    assert batch["usage"] == ref_batch["usage"]
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert batch["endpoint"] == ref_batch["endpoint"]
    assert batch["output_file_id"] == str(folder / "output.jsonl")
    done = job_status(job)
    assert done["status"] == "completed" and done["request_counts"] == batch["request_counts"]

    # A duplicate delivery writes nothing; finalizing again writes the same bytes.
    snapshot = {
        n: (folder / n).read_bytes() for n in ("output.jsonl", "errors.jsonl", "batch.json")
    }
    msg = sub.messages[0]
    assert write_shard_result(job, msg.shard_id, [(0, {"other": "delivery"})]) is False
    assert try_finalize(job).to_dict() == record.to_dict()
    assert {n: (folder / n).read_bytes() for n in snapshot} == snapshot
    # The merge through many run files on disk (a million answers) writes the same bytes.
    monkeypatch.setattr(finalize, "RUN_BYTES", 512)
    assert try_finalize(job).to_dict() == record.to_dict()
    assert {n: (folder / n).read_bytes() for n in snapshot} == snapshot
    monkeypatch.undo()

    # A finalizer that died after writing the output: the next one completes the record.
    (folder / "batch.json").write_text("{}")
    try_finalize(job)
    assert {n: (folder / n).read_bytes() for n in snapshot} == snapshot


def test_poison_shard_becomes_error_records(tmp_path: Path, make_llm, tiny_chat_model: Path):
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400, max_attempts=2)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    poison, rest = sub.messages[0], sub.messages[1:]
    assert read_manifest(job)["max_attempts"] == 2
    assert record_attempt(job, poison.shard_id, 2) == 1
    assert record_attempt(job, poison.shard_id, 2) == 2  # the worker died: redelivered
    assert record_attempt(job, poison.shard_id, 2) is None  # over the cap
    assert record_attempt(job, rest[0].shard_id, 2) == 1  # counted per shard
    assert fail_shard(job, poison, "worker lost twice (SIGKILL)")
    assert fail_shard(job, poison, "again") is False  # written once
    run_shards(make_llm(), job, rest)
    record = try_finalize(job)
    assert record is not None

    folder = Path(sub.dir_uri)
    out, err = read_jsonl(folder / "output.jsonl"), read_jsonl(folder / "errors.jsonl")
    poisoned = json.loads(Path(poison.uri).read_bytes().splitlines()[0])  # a request of it
    failed = [e for e in err if e["error"]["code"] == "shard_failed"]
    entry = read_manifest(job)["shards"][0]
    assert len(failed) == entry["num_requests"]
    assert poisoned["custom_id"] in {e["custom_id"] for e in failed}
    for e in failed:
        assert e["error"]["message"].startswith(f"line {e['error']['line']}: shard ")
        assert "SIGKILL" in e["error"]["message"]
    assert [e["error"]["line"] for e in err] == sorted(e["error"]["line"] for e in err)
    assert len(out) == sub.num_requests - len(failed)
    assert record.completed == len(out) and record.failed == len(err)
    assert record.total == sub.num_requests + sub.num_invalid


@pytest.mark.slow
def test_s3_round_trip(s3_server: S3Server, tmp_path: Path, make_llm, tiny_chat_model: Path):
    bucket = s3_server.make_bucket()
    lines = rag_lines(seed=1)[:8]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    open_storage(f"s3://{bucket}/in/job.jsonl").write_bytes(src.read_bytes())
    from kvbatch.jobs.distributed.submit import prepare_job

    sub = prepare_job(
        f"s3://{bucket}/in/job.jsonl",
        f"s3://{bucket}/jobs",
        str(tiny_chat_model),
        model_name="tiny-chat",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        shard_tokens=200,
    )
    assert sub.dir_uri == f"s3://{bucket}/jobs/{sub.job_id}"
    assert all(m.uri.startswith(f"s3://{bucket}/jobs/{sub.job_id}/shards/") for m in sub.messages)
    job = job_dir(f"s3://{bucket}/jobs", sub.job_id)
    run_shards(make_llm(), job, sub.messages)
    record = try_finalize(job)
    assert record is not None and record.total == len(lines)
    out = read_jsonl(job.join("output.jsonl").open_read().read())
    err = read_jsonl(job.join("errors.jsonl").open_read().read())
    assert len(out) == record.completed == sub.num_requests
    assert len(err) == record.failed == sub.num_invalid
    assert json.loads(job.join("batch.json").open_read().read())["status"] == "completed"

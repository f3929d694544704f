"""A long-context model answers a small job with no --max-model-len: `kvbatch run` and a
worker's shard run what fits the KV cache, and a line that cannot fit gets a
context_length_exceeded error record naming the flag that would admit it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvbatch.jobs.distributed.finalize import read_manifest
from kvbatch.jobs.distributed.shards import job_dir, run_shard
from kvbatch.jobs.local.run import RunOptions, resolve_paths, run_job
from tests.jobs.conftest import LONG_CONTEXT
from tests.jobs.distributed.test_submit import prepare
from tests.jobs.local.test_run import chat, read_jsonl, write_jsonl

POOL_TOKENS = 1024  # the tiny chat Llama's KV is 512 bytes a token
ENGINE = dict(device="cpu", block_size=16, kv_cache_bytes=POOL_TOKENS * 512)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "cache"))


def small_job() -> list[dict]:
    lines = [chat(f"ok{i}", f"say {i}", max_tokens=5) for i in range(3)]
    lines.append(chat("too-long", "write a novel", max_tokens=POOL_TOKENS))
    return lines


def assert_only_the_long_line_refused(out: list[dict], err: list[dict]) -> None:
    assert sorted(x["custom_id"] for x in out) == ["ok0", "ok1", "ok2"]
    assert all(x["error"] is None for x in out)
    assert [x["custom_id"] for x in err] == ["too-long"]
    error = err[0]["error"]
    assert error["code"] == "context_length_exceeded"
    assert "--max-model-len" in error["message"] and "--kv-cache-bytes" in error["message"]
    assert f"up to {LONG_CONTEXT}" in error["message"]
    assert "max_model_len" not in error["message"]  # the command line names flags


def test_kvbatch_run_answers_a_small_job_with_no_flag(
    tmp_path: Path, long_context_chat_model: Path, caplog
):
    src = write_jsonl(tmp_path / "in.jsonl", small_job())
    opts = RunOptions(input=str(src), model=str(long_context_chat_model), engine=dict(ENGINE))
    with caplog.at_level(logging.INFO):
        record = run_job(opts)
    assert record.status == "completed"
    startup = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache (")]
    assert len(startup) == 1 and f"max_model_len={POOL_TOKENS}" in startup[0]
    paths = resolve_paths(opts)
    assert_only_the_long_line_refused(
        read_jsonl(Path(paths.output)), read_jsonl(Path(paths.errors))
    )


def test_a_workers_shard_refuses_only_what_cannot_fit(
    tmp_path: Path, long_context_chat_model: Path
):
    from kvbatch.engine import LLM

    sub = prepare(tmp_path, long_context_chat_model, small_job(), max_model_len=None)
    job = job_dir(str(tmp_path / "out"), sub.job_id)
    manifest = read_manifest(job)
    llm = LLM(model=str(long_context_chat_model), **ENGINE)  # a worker without --max-model-len
    lines = []
    for msg in sub.messages:
        lines += [line for _, line in run_shard(
            llm, msg, model_name=manifest["model_name"], batch_id=manifest["batch_id"]
        )]  # fmt: skip
    out = [x for x in lines if x["error"] is None]
    err = [x for x in lines if x["error"] is not None]
    assert_only_the_long_line_refused(out, err)

"""A job without --max-model-len runs at its longest request (prompt + output cap, capped at
the model's context and at what the KV cache holds): `kvbatch run`, `kvbatch submit` (job.json
records it) and a worker's shard; an explicit --max-model-len wins."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvbatch.jobs.distributed.finalize import read_manifest
from kvbatch.jobs.distributed.shards import job_dir
from kvbatch.jobs.local.run import RunOptions, resolve_paths, run_job
from kvbatch.worker import tasks
from kvbatch.worker.app import TASK_NAME, make_app
from tests.engine.pooling.st_checkpoints import build_embedding_checkpoint, ids_to_text
from tests.jobs.conftest import LONG_CONTEXT
from tests.jobs.distributed.test_submit import prepare
from tests.jobs.local.test_run import chat, completion, read_jsonl, write_jsonl

ROOMY_POOL = 4096  # tokens; the tiny chat Llama's KV is 512 bytes a token
ROOMY = dict(device="cpu", block_size=16, kv_cache_bytes=ROOMY_POOL * 512)
LONGEST = 40 + 7  # the job below: its longest prompt + max_tokens


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "cache"))


def job() -> list[dict]:
    return [
        completion("short", list(range(100, 110)), max_tokens=5),
        completion("longest", list(range(100, 140)), max_tokens=7),
        completion("long-prompt", list(range(200, 240)), max_tokens=3),
    ]


def startup_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache (")]


def run(tmp_path: Path, model: Path, lines: list[dict], engine: dict, caplog):
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(src), model=str(model), engine=dict(engine))
    with caplog.at_level(logging.INFO):
        record = run_job(opts)
    paths = resolve_paths(opts)
    return record, read_jsonl(Path(paths.output)), read_jsonl(Path(paths.errors))


def test_run_without_the_flag_runs_at_the_jobs_longest_request(
    tmp_path: Path, long_context_chat_model: Path, caplog
):
    record, out, err = run(tmp_path, long_context_chat_model, job(), ROOMY, caplog)
    assert record.status == "completed" and err == []
    assert sorted(x["custom_id"] for x in out) == ["long-prompt", "longest", "short"]
    (startup,) = startup_lines(caplog)
    assert f"max_model_len={LONGEST} (the job's longest request)" in startup


def test_an_explicit_max_model_len_wins(tmp_path: Path, long_context_chat_model: Path, caplog):
    engine = dict(ROOMY, max_model_len=512)
    record, out, err = run(tmp_path, long_context_chat_model, job(), engine, caplog)
    assert record.status == "completed" and len(out) == 3 and err == []
    (startup,) = startup_lines(caplog)
    assert "max_model_len=512 (max_model_len set)" in startup


def test_a_line_without_max_tokens_asks_for_the_whole_context_and_runs_in_what_fits(
    tmp_path: Path, long_context_chat_model: Path, caplog
):
    """No max_tokens: the answer may run to the context's end, so the job asks for the model's
    32k; the KV cache holds 256 tokens, so the engine runs at that. The uncapped line still
    answers (its cap cut to the room left); a line whose own max_tokens cannot fit is refused
    alone, naming the flags that would admit it."""
    pool = 256
    engine = dict(ROOMY, kv_cache_bytes=pool * 512)
    lines = [
        completion("fits", list(range(100, 110)), max_tokens=5),
        chat("uncapped", "tell me everything"),
        completion("too-long", list(range(100, 110)), max_tokens=pool),
    ]
    del lines[1]["body"]["max_tokens"]
    record, out, err = run(tmp_path, long_context_chat_model, lines, engine, caplog)
    (startup,) = startup_lines(caplog)
    assert f"max_model_len={pool} (what the KV cache holds)" in startup
    capped = [r.getMessage() for r in caplog.records if "does not fit the KV cache" in r.message]
    assert len(capped) == 1 and f"the model's context of {LONG_CONTEXT}" in capped[0]
    assert sorted(x["custom_id"] for x in out) == ["fits", "uncapped"]
    uncapped = next(x for x in out if x["custom_id"] == "uncapped")["response"]["body"]
    usage = uncapped["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= pool
    (refused,) = err
    assert refused["custom_id"] == "too-long"
    message = refused["error"]["message"]
    assert refused["error"]["code"] == "context_length_exceeded"
    assert "--max-model-len" in message and "--kv-cache-bytes" in message
    assert f"up to {LONG_CONTEXT}" in message and "max_model_len" not in message
    assert record.to_dict()["request_counts"]["completed"] == 2


def test_an_embeddings_job_runs_at_its_longest_input(tmp_path: Path, caplog):
    model = build_embedding_checkpoint(tmp_path / "embedder", mode="lasttoken")
    texts = [ids_to_text([5, 6, 7]), ids_to_text(list(range(5, 25))), ids_to_text([9, 10])]
    lines = [
        {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": t}}
        for i, t in enumerate(texts)
    ]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    longest = max(len(tokenizer.encode(t)) for t in texts)
    record, out, err = run(tmp_path, model, lines, dict(device="cpu"), caplog)
    assert record.status == "completed" and len(out) == 3 and err == []
    (startup,) = startup_lines(caplog)
    assert f"max_model_len={longest} (the job's longest request)" in startup


def test_submit_records_the_longest_request_and_a_worker_runs_the_job_at_it(
    tmp_path: Path, long_context_chat_model: Path
):
    sub = prepare(tmp_path, long_context_chat_model, job(), max_model_len=None)
    output = str(tmp_path / "out")
    manifest = read_manifest(job_dir(output, sub.job_id))
    assert manifest["longest_request"] == LONGEST

    model = tasks.WorkerModel(str(long_context_chat_model), dict(ROOMY))
    at_start = model.llm()  # `kvbatch worker` loads the model before taking a shard
    assert at_start.engine.max_model_len == ROOMY_POOL  # the model's 32k, capped at the cache
    task = make_app("redis://127.0.0.1:1/0").tasks[TASK_NAME]
    task.use_model(model)
    for msg in sub.messages:
        assert tasks.handle_shard(task, output, msg.to_dict()).get("written")
    llm = model.llm()
    assert llm is not at_start and llm.engine.max_model_len == LONGEST
    assert model.llm(LONGEST) is llm  # another shard of the job: the same engine
    answers = read_jsonl(job_dir(output, sub.job_id).join("output.jsonl").path)
    assert sorted(x["custom_id"] for x in answers) == ["long-prompt", "longest", "short"]


def test_a_worker_with_max_model_len_keeps_its_context(long_context_chat_model: Path):
    model = tasks.WorkerModel(str(long_context_chat_model), dict(ROOMY, max_model_len=512))
    llm = model.llm()
    assert model.llm(LONGEST) is llm and llm.engine.max_model_len == 512


def test_the_job_json_of_an_older_submit_keeps_the_workers_engine(long_context_chat_model):
    model = tasks.WorkerModel(str(long_context_chat_model), dict(ROOMY))
    llm = model.llm()
    assert model.llm(0) is llm  # no longest_request recorded

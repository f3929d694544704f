"""An embeddings job and a job of n > 1 / structured lines through real `kvbatch worker`
processes on a real redis-server: the same answers as `kvbatch run`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kvbatch.jobs.distributed.finalize import job_status
from kvbatch.jobs.local.run import RunOptions, run_job
from kvbatch.jobs.storage import open_storage
from tests.engine.pooling.st_checkpoints import build_embedding_checkpoint, ids_to_text
from tests.redis_server import redis_server  # noqa: F401
from tests.worker.test_distributed import Workers, _env, _submit, _wait_completed


def _vectors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for raw in path.read_text().splitlines():
        line = json.loads(raw)
        data = line["response"]["body"]["data"]
        out[line["custom_id"]] = torch.tensor([d["embedding"] for d in data])
    return out


def test_embeddings_job_through_workers(tmp_path: Path, redis_server):  # noqa: F811
    from kvbatch.engine import LLM

    model = build_embedding_checkpoint(tmp_path / "embedder", mode="lasttoken")
    lines = [
        {
            "custom_id": f"doc-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": [ids_to_text([5, 6, 7, 8 + i]), ids_to_text([9, 10 + i])]},
        }
        for i in range(8)
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))

    local = tmp_path / "local.jsonl"
    run_job(
        RunOptions(input=str(source), model=str(model), output=str(local)),
        llm=LLM(model=str(model), device="cpu"),
    )
    want = _vectors(local)

    workers = Workers(tmp_path, redis_server.url, model, _env(), count=1)
    try:
        out = tmp_path / "jobs"
        job_id = _submit(redis_server.url, source, out, model, "--shard-tokens", "20")
        record = _wait_completed(out / job_id, workers)
    finally:
        workers.stop()
    assert record["endpoint"] == "/v1/embeddings"
    assert record["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    got = _vectors(out / job_id / "output.jsonl")
    assert list(got) == [x["custom_id"] for x in lines]
    for custom_id, vectors in got.items():
        assert vectors.shape == want[custom_id].shape == (2, vectors.shape[1])
        cosine = F.cosine_similarity(vectors, want[custom_id], dim=-1)
        assert cosine.min().item() >= 0.9999, (custom_id, cosine)
    # `kvbatch status` reads an embeddings job too (its usage has no completion tokens)
    status = job_status(open_storage(str(out / job_id)))
    assert (status["completed"], status["output_tokens"]) == (8, 0)


def test_choices_and_structured_lines_through_workers(
    tmp_path: Path,
    redis_server,  # noqa: F811
    tiny_chat_model: Path,
):
    from kvbatch.engine import LLM

    def chat(custom_id: str, **body) -> dict:
        body = {"messages": [{"role": "user", "content": custom_id}], "max_tokens": 12, **body}
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body,
        }

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    lines = [
        chat("three", n=3, temperature=1.0, seed=11),
        chat("penalised", temperature=0, frequency_penalty=1.5, logit_bias={"42": 5}),
        chat(
            "json",
            temperature=0,
            max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        ),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    local = tmp_path / "local.jsonl"
    run_job(
        RunOptions(input=str(source), model=str(tiny_chat_model), output=str(local)),
        llm=LLM(model=str(tiny_chat_model), device="cpu"),
    )

    workers = Workers(tmp_path, redis_server.url, tiny_chat_model, _env(), count=1)
    try:
        out = tmp_path / "jobs"
        job_id = _submit(redis_server.url, source, out, tiny_chat_model)
        _wait_completed(out / job_id, workers)
    finally:
        workers.stop()

    def choices(path: Path) -> dict[str, list[str]]:
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        return {
            r["custom_id"]: [c["message"]["content"] for c in r["response"]["body"]["choices"]]
            for r in rows
        }

    got = choices(out / job_id / "output.jsonl")
    assert got == choices(local)
    assert len(got["three"]) == 3

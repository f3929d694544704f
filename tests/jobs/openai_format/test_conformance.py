"""Every job shape's files against the published schemas: batch.json as `openai.types.Batch`;
every output and error line as OpenAI's batch output line and as vLLM's `BatchRequestOutput`
(vllm/entrypoints/openai/run_batch.py, written out below), each body as the openai SDK's type
for its endpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types import Batch, BatchError, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict

from kvbatch.jobs.local.run import RunOptions, resolve_paths, run_job
from tests.engine.pooling.st_checkpoints import build_embedding_checkpoint
from tests.jobs.local.test_run import MODEL_NAME, chat, completion, llm  # noqa: F401

# -- vLLM's batch line schema (run_batch.py: BatchResponseData, BatchRequestOutput) -----------


class VllmBatchResponseData(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's OpenAIBaseModel allows extra fields

    status_code: int = 200
    request_id: str
    body: dict[str, Any] | None = None  # checked with the openai SDK's types below


class VllmBatchRequestOutput(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    custom_id: str
    response: VllmBatchResponseData | None
    error: Any | None


# -- OpenAI's batch output line (platform docs: the batch output and error files) ------------


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    status_code: int
    request_id: str
    body: dict[str, Any]


class OpenAIBatchLine(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    custom_id: str
    response: OpenAIResponse | None
    error: BatchError | None


BODY_TYPES = {
    "chat.completion": ChatCompletion,
    "text_completion": Completion,
    "list": CreateEmbeddingResponse,
}


def check_line(raw: str) -> dict:
    line = json.loads(raw)
    VllmBatchRequestOutput.model_validate(line)
    OpenAIBatchLine.model_validate(line)
    assert (line["response"] is None) != (line["error"] is None)
    if line["response"] is not None:
        body = line["response"]["body"]
        BODY_TYPES[body["object"]].model_validate(body)
    return line


def run(tmp_path: Path, model, lines: list, **opts) -> tuple[list[dict], list[dict], dict]:
    source = tmp_path / "in.jsonl"
    source.write_bytes(
        b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)
    )
    options = RunOptions(input=str(source), model=model.engine.config.model, **opts)
    run_job(options, llm=model)
    paths = resolve_paths(options)
    out = [check_line(x) for x in Path(paths.output).read_text().splitlines()]
    errors = [check_line(x) for x in Path(paths.errors).read_text().splitlines()]
    batch = json.loads(Path(paths.batch).read_text())
    Batch.model_validate(batch)
    assert batch["request_counts"]["total"] == len(out) + len(errors)
    return out, errors, batch


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    from kvbatch.engine import LLM

    path = build_embedding_checkpoint(tmp_path_factory.mktemp("embedder") / "m", mode="lasttoken")
    return LLM(model=str(path), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)


def test_empty_job(tmp_path: Path, llm):  # noqa: F811
    out, errors, batch = run(tmp_path, llm, [])
    assert (out, errors, batch["status"]) == ([], [], "failed")


def test_a_job_of_bad_lines_only(tmp_path: Path, llm):  # noqa: F811
    lines = [b"not json", {"custom_id": "a"}, chat("b", "hi", n=0), b'{"custom_id": 5}']
    out, errors, batch = run(tmp_path, llm, lines)
    assert out == [] and batch["status"] == "failed"
    assert [e["custom_id"] for e in errors] == ["kvbatch-line-1", "a", "b", "kvbatch-line-4"]
    assert "no usable custom_id" in errors[0]["error"]["message"]
    assert len(batch["errors"]["data"]) == 4


def test_mixed_chat_and_completions(tmp_path: Path, llm):  # noqa: F811
    lines = [
        chat("c1", "hello", n=2, temperature=0.7, seed=1, logprobs=True, top_logprobs=1),
        completion("p1", "once upon a time", logprobs=2),
        chat("j1", "a thing", response_format={"type": "json_object"}, max_tokens=20),
        b"{oops",
        {**chat("e1", "hi"), "url": "/v1/embeddings"},  # no input: a per-line error
    ]
    out, errors, batch = run(tmp_path, llm, lines)
    assert [x["custom_id"] for x in out] == ["c1", "p1", "j1"]
    assert [x["custom_id"] for x in errors] == ["kvbatch-line-4", "e1"]
    assert batch["status"] == "completed" and batch["endpoint"] == "/v1/chat/completions"
    assert all(x["response"]["body"]["model"] == MODEL_NAME for x in out)


def test_the_model_label_is_the_jobs_not_a_later_lines(tmp_path: Path, llm):  # noqa: F811
    first = chat("a", "hi")
    del first["body"]["model"]
    lines = [first, chat("b", "hi", model="other-model")]
    out, errors, _ = run(tmp_path, llm, lines)
    label = Path(llm.engine.config.model.rstrip("/")).name
    assert [x["response"]["body"]["model"] for x in out] == [label, label]
    assert errors == []


def test_embeddings_job(tmp_path: Path, embedder):
    lines = [
        {
            "custom_id": "e1",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": "<5> <6>"},
        },
        {
            "custom_id": "e2",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"input": [[5, 6], [7]], "dimensions": 8},
        },
        chat("c1", "not here", model="emb"),
    ]
    out, errors, batch = run(tmp_path, embedder, lines, model_name="emb")
    assert [x["custom_id"] for x in out] == ["e1", "e2"]
    assert [x["error"]["code"] for x in errors] == ["invalid_url"]
    assert batch["endpoint"] == "/v1/embeddings" and batch["status"] == "completed"
    assert batch["usage"]["input_tokens"] == 2 + 3 and batch["usage"]["output_tokens"] == 0

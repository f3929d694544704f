"""`/v1/embeddings` lines through `kvbatch run`, on a tiny random checkpoint with
sentence-transformers' pooling files, against sentence-transformers on the same folder."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from openai.types import Batch, CreateEmbeddingResponse

from kvbatch.jobs.distributed.finalize import try_finalize
from kvbatch.jobs.distributed.shards import job_dir
from kvbatch.jobs.distributed.submit import prepare_job
from kvbatch.jobs.local.run import RunOptions, run_job
from tests.engine.pooling.st_checkpoints import (
    build_bert_checkpoint,
    build_embedding_checkpoint,
    ids_to_text,
    st_embeddings,
)
from tests.jobs.distributed.test_finalize import run_shards

MIN_COSINE = 0.9999
EMBED = "/v1/embeddings"
DOC = [5, 9, 14, 20, 33, 41, 7, 8, 90, 91, 92, 93]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from kvbatch.engine import LLM

    path = build_embedding_checkpoint(tmp_path_factory.mktemp("embedder") / "m", mode="mean")
    return LLM(model=str(path), device="cpu", block_size=4, num_kv_blocks=128, max_model_len=64)


def line(custom_id: str, body: dict, url: str = EMBED) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run(tmp_path: Path, llm, lines: list[dict]) -> tuple[dict, dict, dict]:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    opts = RunOptions(model=llm.engine.config.model, input=str(path), model_name="embedder")
    run_job(opts, llm=llm)

    def read(name: str) -> dict:
        file = tmp_path / name
        rows = [json.loads(x) for x in file.read_text().splitlines()] if file.exists() else []
        return {r["custom_id"]: r for r in rows}

    batch = json.loads((tmp_path / "in.output.batch.json").read_text())
    return read("in.output.jsonl"), read("in.output.errors.jsonl"), batch


def vectors(body: dict) -> torch.Tensor:
    rows = []
    for item in body["data"]:
        value = item["embedding"]
        if isinstance(value, str):
            value = np.frombuffer(base64.b64decode(value), dtype="<f4").copy()
        rows.append(torch.tensor(value, dtype=torch.float32))
    return torch.stack(rows)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert F.cosine_similarity(got, want, dim=-1).min().item() >= MIN_COSINE


def test_every_input_shape_matches_sentence_transformers(tmp_path: Path, llm):
    texts = [ids_to_text(DOC + [50 + i]) for i in range(3)]
    lines = [
        line("one-string", {"input": texts[0], "model": "embedder"}),
        line("strings", {"input": texts}),
        line("ids", {"input": DOC + [50]}),
        line("id-lists", {"input": [DOC + [51], DOC + [52]], "encoding_format": "base64"}),
        line("short", {"input": texts[:2], "dimensions": 8}),
        line("short-b64", {"input": texts[0], "dimensions": 8, "encoding_format": "base64"}),
        line("too-wide", {"input": texts[0], "dimensions": 4096}),
        line("bad-id", {"input": [DOC, [10**9]]}),
        line("chat", {"messages": [{"role": "user", "content": "hi"}]}, "/v1/chat/completions"),
        line("empty", {"input": []}),
    ]
    out, errors, batch = run(tmp_path, llm, lines)
    path = Path(llm.engine.config.model)
    want = st_embeddings(path, texts)
    for body in (r["response"]["body"] for r in out.values()):
        # openai's client decodes base64 vectors into floats before it builds the type
        decoded = [{**d, "embedding": v.tolist()} for d, v in zip(body["data"], vectors(body))]
        CreateEmbeddingResponse.model_validate({**body, "data": decoded})
        assert body["model"] == "embedder"
    assert_close(vectors(out["one-string"]["response"]["body"]), want[:1])
    assert_close(vectors(out["strings"]["response"]["body"]), want)
    assert_close(vectors(out["ids"]["response"]["body"]), want[:1])
    assert_close(vectors(out["id-lists"]["response"]["body"]), want[1:])
    assert [d["index"] for d in out["strings"]["response"]["body"]["data"]] == [0, 1, 2]
    usage = out["strings"]["response"]["body"]["usage"]
    assert usage == {"prompt_tokens": 3 * (len(DOC) + 1), "total_tokens": 3 * (len(DOC) + 1)}

    short = st_embeddings(path, texts[:2], truncate_dim=8, normalize_embeddings=True)
    assert_close(vectors(out["short"]["response"]["body"]), short)
    b64 = vectors(out["short-b64"]["response"]["body"])
    assert torch.equal(b64, vectors(out["short"]["response"]["body"])[:1])  # base64 is exact

    assert errors["too-wide"]["error"]["code"] == "invalid_parameter"
    assert "dimensions=4096 is out of range" in errors["too-wide"]["error"]["message"]
    assert errors["bad-id"]["error"]["code"] == "invalid_prompt"
    assert "input 1: token id 1000000000" in errors["bad-id"]["error"]["message"]
    assert errors["chat"]["error"]["code"] == "invalid_url"
    assert "a batch has one endpoint" in errors["chat"]["error"]["message"]
    assert errors["empty"]["error"]["code"] == "invalid_parameter"

    record = Batch.model_validate(batch)
    assert record.endpoint == EMBED
    assert record.request_counts.completed == 6 and record.request_counts.failed == 4
    assert record.usage.input_tokens == sum(
        r["response"]["body"]["usage"]["prompt_tokens"] for r in out.values()
    )


@pytest.mark.parametrize("model", ["llm", "bert"])
def test_workers_answer_as_kvbatch_run(tmp_path: Path, request, model):
    """prepare_job cuts the job into shards (an embeddings line's inputs stay in one shard),
    run_shard answers them, try_finalize merges: the same lines as `kvbatch run` writes
    (a decoder, and an encoder through the encoder engine)."""
    llm = request.getfixturevalue(model)
    lines = [
        line(f"doc-{i}", {"input": [ids_to_text(DOC[: 4 + i]), ids_to_text(DOC + [i])]})
        for i in range(6)
    ]
    lines.append(line("b64", {"input": DOC, "encoding_format": "base64", "dimensions": 16}))
    lines.append(line("too-wide", {"input": DOC, "dimensions": 4096}))
    local_out, local_errors, _ = run(tmp_path, llm, lines)

    src = tmp_path / "in.jsonl"
    sub = prepare_job(
        str(src),
        str(tmp_path / "jobs"),
        llm.engine.config.model,
        model_name="embedder",
        shard_tokens=40,
        block_size=4,
        max_model_len=64,
    )
    assert len(sub.messages) > 1 and sub.num_requests == len(lines)
    job = job_dir(str(tmp_path / "jobs"), sub.job_id)
    run_shards(llm, job, sub.messages)
    record = try_finalize(job)
    assert record is not None and record.endpoint == EMBED
    out = [json.loads(x) for x in (Path(job.uri) / "output.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines[:-1]]
    for got in out:
        want = local_out[got["custom_id"]]["response"]["body"]
        assert_close(vectors(got["response"]["body"]), vectors(want))
        assert got["response"]["body"]["usage"] == want["usage"]
    errors = [json.loads(x) for x in (Path(job.uri) / "errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["too-wide"] == list(local_errors)
    assert record.completed == len(lines) - 1 and record.failed == 1


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from kvbatch.engine import LLM

    path = build_bert_checkpoint(tmp_path_factory.mktemp("bert") / "m", mode="cls")
    return LLM(model=str(path), device="cpu", max_num_batched_tokens=64)


def test_a_bert_job_matches_sentence_transformers(tmp_path: Path, bert):
    """An encoder checkpoint (BERT, CLS pooling) answers `/v1/embeddings` lines through the
    encoder engine: the same bodies as a decoder's, an input longer than the model's 128
    positions refused on its line."""
    texts = [ids_to_text(DOC[: 2 + i] * (1 + 3 * i)) for i in range(4)]
    lines = [
        line("strings", {"input": texts}),
        line("ids", {"input": [DOC, DOC[:1]], "encoding_format": "base64"}),
        line("short", {"input": texts[1:3], "dimensions": 8}),
        line("too-long", {"input": [texts[0], ids_to_text(DOC * 11)]}),
    ]
    out, errors, batch = run(tmp_path, bert, lines)
    path = Path(bert.engine.config.model)
    assert_close(vectors(out["strings"]["response"]["body"]), st_embeddings(path, texts))
    ids_texts = [ids_to_text(DOC), ids_to_text(DOC[:1])]
    assert_close(vectors(out["ids"]["response"]["body"]), st_embeddings(path, ids_texts))
    short = st_embeddings(path, texts[1:3], truncate_dim=8, normalize_embeddings=True)
    assert_close(vectors(out["short"]["response"]["body"]), short)
    assert errors["too-long"]["error"]["code"] == "context_length_exceeded"
    assert "input 1 has 132 tokens" in errors["too-long"]["error"]["message"]
    assert Batch.model_validate(batch).request_counts.completed == 3


@pytest.mark.parametrize(
    "url, body, message",
    [
        ("/v1/completions", {"prompt": "<5> <6>"}, r"\(BertModel\) is an encoder: it embeds"),
        # a BERT tokenizer has no chat template: refused before the engine sees the line
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<5>"}]}, "template"),
    ],
)
def test_generation_lines_on_an_encoder_are_refused_per_line(
    tmp_path: Path, bert, url, body, message
):
    out, errors, batch = run(tmp_path, bert, [line("a", body, url), line("b", body, url)])
    assert not out and sorted(errors) == ["a", "b"]
    for e in errors.values():
        assert e["error"]["code"] == "invalid_prompt"
        assert re.search(message, e["error"]["message"])
    assert Batch.model_validate(batch).request_counts.failed == 2


def test_submit_refuses_what_the_encoder_would(tmp_path: Path):
    """`kvbatch submit` checks input lengths against the limit the encoder engine keeps
    (sentence_bert_config.json's max_seq_length, not the 128 positions): such a line is
    refused at submit as context_length_exceeded, not later by a worker."""
    path = build_bert_checkpoint(tmp_path / "m", mode="cls")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    src = tmp_path / "in.jsonl"
    lines = [line("fits", {"input": (DOC * 2)[:16]}), line("long", {"input": (DOC * 2)[:17]})]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    sub = prepare_job(str(src), str(tmp_path / "jobs"), str(path), job_id="j1")
    assert (sub.num_requests, sub.num_invalid) == (1, 1)
    (error,) = [json.loads(x) for x in (tmp_path / "jobs/j1/validation_errors.jsonl").open()]
    assert error["custom_id"] == "long"
    assert error["error"]["code"] == "context_length_exceeded"

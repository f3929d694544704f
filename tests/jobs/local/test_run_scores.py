"""`/v1/score` and `/v1/rerank` lines through `kvbatch run`, on a tiny BERT cross-encoder and a
tiny Qwen3 yes/no reranker, against sentence-transformers' CrossEncoder on the same folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbatch.engine import LLM
from kvbatch.jobs.distributed.finalize import try_finalize
from kvbatch.jobs.distributed.shards import job_dir
from kvbatch.jobs.distributed.submit import prepare_job
from kvbatch.jobs.local.run import RunOptions, run_job
from tests.engine.pooling.rerank_checkpoints import build_bert_cross_encoder, build_qwen3_reranker
from tests.engine.pooling.st_checkpoints import build_bert_checkpoint
from tests.jobs.distributed.test_finalize import run_shards

QUERY = "how do tides form"
DOCS = [
    "Tides are caused by the gravitational pull of the Moon and the Sun.",
    "Volcanoes erupt when magma rises through the crust.",
    "A lighthouse guides ships at night.",
]


def cross_encoder_scores(path, pairs):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu").predict(pairs, batch_size=3).tolist()


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def job_lines() -> list[dict]:
    return [
        line("score-one", "/v1/score", {"text_1": QUERY, "text_2": DOCS}),
        line("score-zip", "/v1/score", {"text_1": [QUERY, DOCS[1]], "text_2": DOCS[:2]}),
        line("rerank", "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}),
        line("rerank-all", "/v1/rerank", {"query": DOCS[2], "documents": DOCS}),
        line("no-query", "/v1/rerank", {"documents": DOCS}),
        line("no-docs", "/v1/rerank", {"query": QUERY, "documents": []}),
        line("top-minus", "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}),
        line("uneven", "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}),
        line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]


def run(tmp_path: Path, llm, lines: list[dict]) -> tuple[dict, dict]:
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run_job(RunOptions(model=llm.engine.config.model, input=str(path), model_name="rr"), llm=llm)

    def read(name: str) -> dict:
        file = tmp_path / name
        rows = [json.loads(x) for x in file.read_text().splitlines()] if file.exists() else []
        return {r["custom_id"]: r for r in rows}

    return read("in.output.jsonl"), read("in.output.errors.jsonl")


def check_job(tmp_path: Path, llm, checkpoint: Path) -> dict:
    out, errors = run(tmp_path, llm, job_lines())
    want = cross_encoder_scores(checkpoint, [(QUERY, d) for d in DOCS])
    assert llm.score(QUERY, DOCS) == pytest.approx(want, abs=1e-5)

    body = out["score-one"]["response"]["body"]
    assert body["object"] == "list" and body["model"] == "rr" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0

    zipped = out["score-zip"]["response"]["body"]["data"]
    pairs = [(QUERY, DOCS[0]), (DOCS[1], DOCS[1])]
    assert [d["score"] for d in zipped] == pytest.approx(
        cross_encoder_scores(checkpoint, pairs), abs=1e-5
    )

    ranked = out["rerank"]["response"]["body"]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in ranked["results"]] == best
    assert [r["document"]["text"] for r in ranked["results"]] == [DOCS[i] for i in best]
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
        [want[i] for i in best], abs=1e-5
    )
    everything = out["rerank-all"]["response"]["body"]["results"]
    scores = [r["relevance_score"] for r in everything]
    assert len(everything) == 3 and scores == sorted(scores, reverse=True)
    assert scores == pytest.approx(
        sorted(cross_encoder_scores(checkpoint, [(DOCS[2], d) for d in DOCS]), reverse=True),
        abs=1e-5,
    )

    codes = {k: (e["error"]["code"], e["error"]["line"]) for k, e in errors.items()}
    assert codes == {
        "no-query": ("missing_prompt", 5),
        "no-docs": ("invalid_parameter", 6),
        "top-minus": ("invalid_parameter", 7),
        "uneven": ("invalid_parameter", 8),
        "chat": ("invalid_url", 9),
    }
    messages = {k: e["error"]["message"] for k, e in errors.items()}
    assert "query" in messages["no-query"]
    assert "documents" in messages["no-docs"]
    assert "top_n" in messages["top-minus"]
    assert "same length" in messages["uneven"]
    assert "scoring" in messages["chat"]
    return out


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[Path, LLM]:
    checkpoint = build_bert_cross_encoder(tmp_path_factory.mktemp("ce") / "m")
    return checkpoint, LLM(model=str(checkpoint), max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2_dir) -> tuple[Path, LLM]:
    checkpoint = build_qwen3_reranker(tmp_path_factory.mktemp("rr") / "m", smollm2_dir)
    llm = LLM(model=str(checkpoint), max_num_seqs=2, max_num_batched_tokens=128, block_size=4)
    return checkpoint, llm


@pytest.mark.parametrize("model", ["bert", "qwen3"])
def test_a_scoring_job_matches_sentence_transformers(tmp_path: Path, request, model):
    checkpoint, llm = request.getfixturevalue(model)
    out = check_job(tmp_path / "job", llm, checkpoint)
    usage = out["rerank-all"]["response"]["body"]["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # a decoder reranker's prompts open with the instruction and the query: the pairs of one
    # query share that prefix in the cache; a cross-encoder reads each pair whole
    assert 0 < cached < usage["prompt_tokens"] if model == "qwen3" else cached == 0


@pytest.mark.parametrize("model", ["bert", "qwen3"])
def test_workers_answer_as_kvbatch_run(tmp_path: Path, request, model):
    """prepare_job cuts the job into shards (a line's pairs stay in one shard), run_shard
    answers them, try_finalize merges: the same lines as `kvbatch run` writes."""
    checkpoint, llm = request.getfixturevalue(model)
    lines = job_lines()[:-1]  # the chat line is refused by the endpoint rule alike
    lines += [
        line(f"rr-{i}", "/v1/rerank", {"query": DOCS[i % 3], "documents": DOCS, "top_n": 1})
        for i in range(4)
    ]
    local_out, local_errors = run(tmp_path / "local", llm, lines)

    sub = prepare_job(
        str(tmp_path / "local" / "in.jsonl"),
        str(tmp_path / "jobs"),
        llm.engine.config.model,
        model_name="rr",
        shard_tokens=150,
        block_size=4,
    )
    assert len(sub.messages) > 1
    job = job_dir(str(tmp_path / "jobs"), sub.job_id)
    run_shards(llm, job, sub.messages)
    record = try_finalize(job)
    assert record is not None and record.endpoint == "/v1/score"
    out = [json.loads(x) for x in (Path(job.uri) / "output.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == [x for x in local_out]
    for got in out:
        body, want = got["response"]["body"], local_out[got["custom_id"]]["response"]["body"]
        assert set(body) == set(want)
        assert body["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        if "results" in body:
            assert [r["index"] for r in body["results"]] == [r["index"] for r in want["results"]]
            got_scores = [r["relevance_score"] for r in body["results"]]
            want_scores = [r["relevance_score"] for r in want["results"]]
            assert got_scores == pytest.approx(want_scores, abs=1e-5)  # batched otherwise
        else:
            got_scores = [d["score"] for d in body["data"]]
            assert got_scores == pytest.approx([d["score"] for d in want["data"]], abs=1e-5)
    errors = [json.loads(x) for x in (Path(job.uri) / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["custom_id"] for e in errors) == sorted(local_errors)


def test_score_lines_on_an_embedding_model_are_errors(tmp_path: Path):
    """A model that cannot score pairs (an embedding BERT) answers no score line: each is an
    error record saying why."""
    lines = [
        line("s", "/v1/score", {"text_1": QUERY, "text_2": DOCS}),
        line("r", "/v1/rerank", {"query": QUERY, "documents": DOCS}),
    ]
    llm = LLM(model=str(build_bert_checkpoint(tmp_path / "embedder")))
    out, errors = run(tmp_path / "job", llm, lines)
    assert out == {}
    assert {k: (e["error"]["code"], e["error"]["line"]) for k, e in errors.items()} == {
        "s": ("invalid_prompt", 1),
        "r": ("invalid_prompt", 2),
    }
    assert all(
        "scoring pairs needs a cross-encoder" in e["error"]["message"] for e in errors.values()
    )


def test_score_lines_on_a_chat_model_are_errors(tmp_path: Path, tiny_chat_model: Path):
    """A generation-only model (SmolLM2's chat template renders any role) scores no pair:
    each score line is an error record saying it needs a reranker."""
    lines = [
        line("s", "/v1/score", {"text_1": QUERY, "text_2": DOCS}),
        line("r", "/v1/rerank", {"query": QUERY, "documents": DOCS}),
    ]
    llm = LLM(model=str(tiny_chat_model), max_model_len=256, block_size=4)
    out, errors = run(tmp_path, llm, lines)
    assert out == {}
    assert {k: (e["error"]["code"], e["error"]["line"]) for k, e in errors.items()} == {
        "s": ("invalid_url", 1),
        "r": ("invalid_url", 2),
    }
    assert all("not a reranker" in e["error"]["message"] for e in errors.values())


def test_truncate_prompt_tokens_cuts_as_sentence_transformers(tmp_path: Path, bert):
    """truncate_prompt_tokens cuts the pair longest-first, as CrossEncoder(max_length=...)
    does; without it a pair longer than the model takes is an error record."""
    from sentence_transformers import CrossEncoder

    checkpoint, llm = bert
    long_doc = " ".join(DOCS * 40)
    lines = [
        line("cut", "/v1/score", {"text_1": QUERY, "text_2": [long_doc, DOCS[0]],
                                  "truncate_prompt_tokens": 12}),
        line("long", "/v1/rerank", {"query": QUERY, "documents": [DOCS[0], long_doc]}),
    ]  # fmt: skip
    out, errors = run(tmp_path, llm, lines)
    want = CrossEncoder(str(checkpoint), device="cpu", max_length=12).predict(
        [(QUERY, long_doc), (QUERY, DOCS[0])]
    )
    got = [d["score"] for d in out["cut"]["response"]["body"]["data"]]
    assert got == pytest.approx(want.tolist(), abs=1e-5)
    assert out["cut"]["response"]["body"]["usage"]["prompt_tokens"] == 24
    error = errors["long"]["error"]
    assert (error["code"], error["line"]) == ("context_length_exceeded", 2)
    assert "pair 1" in error["message"] and "truncate_prompt_tokens" in error["message"]


def test_vllm_no_limit_values_top_n_zero_and_truncate_minus_one(tmp_path: Path, bert):
    """A body written for vLLM runs unchanged: top_n 0 (vLLM's default) ranks every document,
    truncate_prompt_tokens -1 cuts at the model's maximum length; 0 and -2 are refused."""
    from sentence_transformers import CrossEncoder

    checkpoint, llm = bert
    limit = llm.engine.max_model_len
    long_doc = " ".join(DOCS * 80)
    lines = [
        line("all", "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}),
        line("max", "/v1/score", {"text_1": QUERY, "text_2": long_doc,
                                  "truncate_prompt_tokens": -1}),
        line("zero", "/v1/score", {"text_1": QUERY, "text_2": DOCS[0],
                                   "truncate_prompt_tokens": 0}),
        line("minus", "/v1/rerank", {"query": QUERY, "documents": DOCS,
                                     "truncate_prompt_tokens": -2}),
    ]  # fmt: skip
    out, errors = run(tmp_path, llm, lines)
    ranked = [r["relevance_score"] for r in out["all"]["response"]["body"]["results"]]
    assert ranked == pytest.approx(sorted(llm.score(QUERY, DOCS), reverse=True), abs=1e-5)
    cut = CrossEncoder(str(checkpoint), device="cpu", max_length=limit).predict([(QUERY, long_doc)])
    body = out["max"]["response"]["body"]
    assert body["data"][0]["score"] == pytest.approx(float(cut[0]), abs=1e-5)
    assert body["usage"]["prompt_tokens"] == limit
    for key in ("zero", "minus"):
        assert errors[key]["error"]["code"] == "invalid_parameter"
        assert "-1 for the model's maximum length" in errors[key]["error"]["message"]

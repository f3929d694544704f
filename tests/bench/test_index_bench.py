"""`kvbatch bench index-cpu --tiny` and `index-retrieval --tiny`: kvbatch index beside the
pipeline a user would write (transformers generate + sentence-transformers encode + LanceDB
add) on real models; the two tables must agree, and one vector off must fail the check. No
speed assertions: speed is the benchmark's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbatch.bench import cli
from kvbatch.bench.index_bench import MIN_COSINE, TINY_INDEX_CPU, compare
from kvbatch.bench.index_run import IndexRows, read_rows


@pytest.mark.slow
def test_index_cpu_tiny_the_two_pipelines_write_the_same_rows(smollm2_dir, tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "index.json"
    args = ["index-cpu", "--tiny", "--threads", "1", "--work", str(work), "--json", str(out)]
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "index-bench" and report["documents"] == TINY_INDEX_CPU.docs
    agreement = report["agreement"]
    assert agreement["agrees"] and agreement["same_texts"]
    assert agreement["kvbatch_rows"] == agreement["user_rows"] == report["chunks"] > 0
    assert agreement["min_cosine"] >= MIN_COSINE
    prefill = report["kvbatch"]["report"]["prefill"]
    # the same prompts on both sides: the user's pipeline prefills every one in full
    assert prefill["no_sharing"] == report["user"]["prompt_tokens"]
    assert prefill["ideal"] <= prefill["computed"] <= 1.02 * prefill["ideal"]
    assert prefill["computed"] < prefill["no_sharing"]  # each document prefilled once
    table = capsys.readouterr().out
    assert "chunks/s" in table and "rows and vectors agree (cosine >= 0.999): yes" in table

    kvbatch, user = read_rows(str(work / "kvbatch.lance")), read_rows(str(work / "user.lance"))
    assert compare(kvbatch, user).agrees
    chunk = next(iter(user.vector))
    off = dict(user.vector)
    off[chunk] = off[chunk] + 0.05 * np.random.default_rng(0).standard_normal(off[chunk].shape)
    bad = compare(kvbatch, IndexRows(user.text, user.context, off))
    assert not bad.agrees and bad.worst_chunk == chunk and bad.min_cosine < MIN_COSINE
    fewer = {c: t for c, t in user.text.items() if c != chunk}
    assert not compare(kvbatch, IndexRows(fewer, user.context, user.vector)).agrees


@pytest.mark.slow
def test_index_retrieval_tiny_scores_plain_and_contextual_chunks(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "retrieval.json"
    assert cli.main(["index-retrieval", "--tiny", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    modes = ["vector", "keyword", "hybrid", "hybrid + rerank"]
    sets = ("summaries", "identifiers")
    assert [(r["name"], r["query_set"], r["mode"]) for r in report["results"]] == [
        (name, queries, mode) for name in ("plain", "contextual") for queries in sets
        for mode in modes
    ]  # fmt: skip
    for r in report["results"]:
        expected = report["corpus"]["documents"] if r["query_set"] == "summaries" else 3
        assert r["queries"] == expected and report["corpus"]["documents"] == 4
        assert 0 < r["mrr"] <= 1 and 0 <= r["recall@5"] <= 1 and r["chunks"] >= 4
    assert report["reranker"].startswith("SmolLM2-135M-Instruct as a zero-shot")
    out = capsys.readouterr().out
    assert "recall@5" in out and "hybrid + rerank" in out


def test_the_index_benchmarks_describe_themselves(capsys):
    for name in ("index-cpu", "index-retrieval"):
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "--tiny" in out and "--docs" in out and "--threads" in out
        if name == "index-cpu":  # documents of 1,000 to 2,500 tokens; the user's batch size
            assert "--long-docs" in out and "--user-batch" in out


def test_a_work_folder_in_use_is_refused(tmp_path, capsys):
    (tmp_path / "old").write_text("x")
    assert cli.main(["index-cpu", "--tiny", "--work", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err

"""`kvbatch bench embed-cpu --tiny`: kvbatch and sentence-transformers on real all-MiniLM-L6-v2,
the report's shape and the agreement check (no speed assertions: speed is the benchmark's)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvbatch.bench import cli
from kvbatch.bench.embed_bench import MIN_COSINE, EmbedBenchError, min_cosine
from kvbatch.bench.embed_workload import EMBED_WORKLOADS, TINY_EMBED_WORKLOADS


def test_embed_cpu_tiny_runs_both_engines_and_their_vectors_agree(tmp_path, capsys):
    out = tmp_path / "embed.json"
    assert cli.main(["embed-cpu", "--tiny", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "embed-bench" and report["agrees"] is True
    assert report["num_texts"] == 24
    lengths = report["workload"]
    assert report["num_tokens"] > report["num_texts"] * lengths["min_tokens"]
    engines = {e["label"]: e for e in report["engines"]}
    assert list(engines) == ["kvbatch", "st batch 8"]
    st = engines["st batch 8"]
    assert st["min_cosine"] >= MIN_COSINE and len(st["seconds"]) == 1
    for e in engines.values():
        assert e["padded_tokens"] >= report["num_tokens"] and e["texts_per_s"] > 0
    table = capsys.readouterr().out
    assert "texts/s" in table and "vectors agree (cosine >= 0.9999 on every text): yes" in table


def test_one_text_off_fails_the_agreement_check():
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((4, 8)).astype(np.float32)
    vectors = reference.copy()
    vectors[2] += 0.05 * rng.standard_normal(8).astype(np.float32)
    cosine, worst = min_cosine(reference, vectors)
    assert worst == 2 and cosine < MIN_COSINE
    assert min_cosine(reference, reference * 3)[0] == pytest.approx(1.0)
    with pytest.raises(EmbedBenchError, match="shape"):
        min_cosine(reference, vectors[:3])


def test_embed_cpu_help_describes_the_workload_and_its_tiny_variant(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["embed-cpu", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert EMBED_WORKLOADS["embed-cpu"].summary() in out
    assert TINY_EMBED_WORKLOADS["embed-cpu"].summary() in out and "--st-batch-sizes" in out

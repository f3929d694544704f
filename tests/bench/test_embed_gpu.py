"""`kvbatch bench embed-gpu --tiny` on the CPU: both model shapes run through kvbatch and the
sentence-transformers-style peer, and the vectors agree; the folders it builds are read by
sentence-transformers itself as the benchmark reads them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from kvbatch.bench import embed_gpu
from kvbatch.bench.embed_models import TINY_EMBED_GPU_MODELS, build_embed_model


def test_tiny_run_agrees_and_reports_the_floor(tmp_path):
    out = tmp_path / "embed.json"
    argv = [
        "--tiny",
        "--repeat",
        "1",
        "--threads",
        "1",
        "--cache-dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    assert embed_gpu.main(argv) == 0
    report = json.loads(out.read_text())
    assert [m["model"] for m in report["models"]] == list(TINY_EMBED_GPU_MODELS)
    assert report["matmul_flops"] > 0
    for model in report["models"]:
        assert model["tokens"] == sum(map(len, embed_gpu.TINY_WORKLOAD.inputs(1000)))
        kvbatch, *peers = model["rows"]
        assert kvbatch["label"] == "kvbatch" and kvbatch["min_cosine"] is None
        assert peers and all(p["min_cosine"] >= embed_gpu.MIN_COSINE["float32"] for p in peers)
        assert all(p["padded_tokens"] >= model["tokens"] for p in peers)


@pytest.mark.parametrize("name", list(TINY_EMBED_GPU_MODELS))
def test_the_peer_is_what_sentence_transformers_computes(tmp_path, name):
    from sentence_transformers import SentenceTransformer

    spec = TINY_EMBED_GPU_MODELS[name]
    folder = build_embed_model(spec, "float32", tmp_path)
    inputs = embed_gpu.TINY_WORKLOAD.inputs(spec.vocab_size)[:12]
    peer = embed_gpu.SortedBatchesPeer(spec, folder, "cpu", "float32", batch_size=4)
    got = peer.embed(inputs)
    st = SentenceTransformer(str(folder), device="cpu")
    with torch.inference_mode():
        want = np.stack(
            [
                st(
                    {
                        "input_ids": torch.tensor([ids]),
                        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                    }
                )["sentence_embedding"][0].numpy()
                for ids in inputs
            ]
        )
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_peer_pooling_otherwise_is_caught(tmp_path):
    spec = TINY_EMBED_GPU_MODELS["bge-base-tiny"]
    folder = build_embed_model(spec, "float32", tmp_path)
    wrong = dataclasses.replace(spec, pooling="mean")  # the folder's files say CLS
    result = embed_gpu.measure_model(
        wrong, embed_gpu.TINY_WORKLOAD, folder, "cpu", "float32", 1, lambda m: None
    )
    assert result["rows"][1]["min_cosine"] < embed_gpu.MIN_COSINE["float32"]


def test_unknown_model_is_refused(capsys):
    assert embed_gpu.main(["--tiny", "--models", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err

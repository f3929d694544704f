"""The transformers peers on the tiny random Llama: hf-static's greedy tokens, batching and
left padding; hf-cb's tokens against hf-static's, its kept manager and its CPU pool."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvbatch.bench.hf_peers import HFContinuousBatchingPeer, HFStaticPeer
from kvbatch.bench.peers import EngineOptions, make_peer
from kvbatch.bench.workloads import make_prompts
from tests.bench.tiny_llama import EOS, TINY, VOCAB


def test_the_peers_registry_alone_lists_every_engine_kvbatch_first():
    """cli.py and harness.py import kvbatch.bench.peers only: its registry must name the
    transformers peers too, or `--peers hf-static` is an unknown engine. (A fresh interpreter,
    so that nothing imported here brings them in.)"""
    code = "from kvbatch.bench.peers import PEERS; print(' '.join(PEERS))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["kvbatch", "kvbatch-sync", "hf-static", "hf-cb"]


# --- hf-static -----------------------------------------------------------------------------


def _hf(model: Path, **options) -> HFStaticPeer:
    peer = make_peer("hf-static", model, EngineOptions(**options))
    assert isinstance(peer, HFStaticPeer)
    peer.load()
    return peer


def test_hf_static_decodes_exactly_max_tokens_ignoring_eos(eos_model):
    peer = _hf(eos_model)
    prompts = make_prompts(TINY, VOCAB)
    result = peer.run(prompts, max_tokens=6)
    assert result.output_tokens == len(prompts) * 6
    assert all(len(t) == 6 for t in result.token_ids)
    assert any(EOS in t for t in result.token_ids)  # EOS was decoded, and decoding went on
    # and it is greedy: EOS is not masked, so it is what a plain forward picks first
    with torch.inference_mode():
        logits = peer.model(torch.tensor([prompts[0]])).logits[0, -1]
    assert result.token_ids[0][0] == int(logits.argmax())
    peer.close()
    assert peer.model is None


def test_hf_static_batches_and_left_padding_give_the_same_greedy_tokens(tiny_model):
    prompts = make_prompts(TINY, VOCAB)
    one_batch = _hf(tiny_model).generate(prompts, 4)
    by_two = _hf(tiny_model, hf_batch_size=2).generate(prompts, 4)
    assert one_batch == by_two
    ragged = [prompts[0][:20], prompts[1], prompts[2][:33]]  # left-padded to 52
    padded = _hf(tiny_model).generate(ragged, 4)
    alone = [_hf(tiny_model, hf_batch_size=1).generate([p], 4)[0] for p in ragged]
    assert padded == alone


# --- hf-cb ---------------------------------------------------------------------------------


def test_hf_cb_decodes_hf_static_tokens_and_times_them(tiny_model):
    prompts = make_prompts(TINY, VOCAB)
    static = _hf(tiny_model).generate(prompts, 4)
    peer = make_peer("hf-cb", tiny_model, EngineOptions())
    assert isinstance(peer, HFContinuousBatchingPeer)
    peer.load()
    result = peer.run(prompts, max_tokens=4)
    assert result.token_ids == static
    assert result.timings is not None and len(result.timings.ttft) == len(prompts)
    assert all(t is None or t > 0 for t in result.timings.ttft + result.timings.tpot)
    peer.close()


def test_hf_cb_keeps_one_manager_for_the_workload_and_not_the_warm_ups(tiny_model, caplog):
    """generate_batch's manager (its KV pool, on CUDA its graphs) is built once, outside the
    timed runs, for the workload's shape; the tiny warm-up's is dropped; close frees it; and
    transformers' warning about a kept manager is not repeated on every call."""
    prompts = make_prompts(TINY, VOCAB)
    peer = make_peer("hf-cb", tiny_model, EngineOptions())
    peer.load()
    model = peer.model

    def kept():
        return getattr(model, "_cached_continuous_batching_manager", None)

    peer.warmup()
    assert kept() is None  # sized for two 8-token prompts: not kept for the workload
    first = peer.run(prompts, max_tokens=4)
    manager = kept()
    assert manager is not None
    again = peer.run(make_prompts(TINY.with_seed(TINY.seed + 1), VOCAB), max_tokens=4)
    assert kept() is manager  # the second run reused it
    assert first.token_ids == _hf(tiny_model).generate(prompts, 4)
    assert len(again.token_ids) == len(prompts) and all(len(t) == 4 for t in again.token_ids)
    peer.close()
    assert kept() is None
    assert "persistent_manager" not in caplog.text


@pytest.mark.parametrize("page_field", ["page_size", "block_size"])
def test_hf_cb_sizes_its_cpu_pool_under_either_name_of_the_page_field(
    tiny_model, monkeypatch, page_field
):
    """transformers 5.17 calls the page `block_size`, 5.24 `page_size`: without the right
    name the CPU pool fell back to transformers' default (all of the machine's memory: 11 s
    for `rag --tiny` on 5.17 against 0.4 s sized to the job)."""
    import transformers

    config = dataclasses.make_dataclass(
        "ContinuousBatchingConfig",
        [(page_field, int, 256), ("num_blocks", int, None), ("max_batch_tokens", int, None)],
    )
    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", config)
    peer = make_peer("hf-cb", tiny_model, EngineOptions())
    peer._signature = {"continuous_batching_config": None}
    sized = peer._cpu_cb_config([[1] * 20, [2] * 5], max_tokens=4)
    assert getattr(sized, page_field) == 16 and sized.num_blocks == 2 + 1 + 4
    other = dataclasses.make_dataclass("ContinuousBatchingConfig", [("pages", int, 1)])
    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", other)
    assert peer._cpu_cb_config([[1] * 20], max_tokens=4) is None

"""The KV pool's size: a default budget is capped at what requests can put to use; an explicit
one is not. (The CUDA profile itself runs in tests/engine/attention/test_triton_backend.py and on the GPU
check.)"""

from __future__ import annotations

import logging

import torch

from kvbatch.engine import LLM
from kvbatch.engine.exec.runner import kv_bytes_per_block
from kvbatch.engine.kv.memory import KV_POOL_REQUESTS_PER_SEQ, kv_blocks_worth_having


def test_blocks_worth_having_counts_full_length_requests():
    assert kv_blocks_worth_having(8, 64, 16) == KV_POOL_REQUESTS_PER_SEQ * 8 * 4
    assert kv_blocks_worth_having(1, 65, 16) == KV_POOL_REQUESTS_PER_SEQ * 5  # a partial block


def test_a_default_budget_is_capped_and_says_so(tiny_models, caplog):
    """The CPU's default 1 GiB holds ~260k blocks of the tiny model; 8 requests of 64 tokens
    can use 4 x 8 x 4 of them."""
    with caplog.at_level(logging.INFO, logger="kvbatch.engine.kv.sizing"):
        llm = LLM(tiny_models("llama-gqa"), device="cpu", max_model_len=64, max_num_seqs=8)
    assert llm.engine.kv.num_blocks == kv_blocks_worth_having(8, 64, 16)
    assert "KV pool capped at 128 blocks" in caplog.text
    assert sum(t.numel() for t in llm.engine.runner.kv_caches) == 2 * 128 * 16 * 2 * 16 * 2


def test_an_explicit_budget_is_not_capped(tiny_models):
    path = tiny_models("llama-gqa")
    budget = 2_000_000
    llm = LLM(path, device="cpu", max_model_len=64, max_num_seqs=8, kv_cache_bytes=budget)
    per_block = kv_bytes_per_block(llm.engine.model, 16, torch.float32)
    assert llm.engine.kv.num_blocks == budget // per_block > kv_blocks_worth_having(8, 64, 16)
    assert (
        LLM(path, device="cpu", max_model_len=64, num_kv_blocks=1000).engine.kv.num_blocks == 1000
    )


def test_a_fraction_that_sizes_nothing_says_so(tiny_models, caplog):
    """kv_cache_memory_fraction sizes CUDA pools from free memory only: asked for on the CPU, or
    beside an explicit pool size, it changes nothing, and a warning says why; the default is
    quiet."""
    path = tiny_models("llama-gqa")
    args = dict(device="cpu", max_model_len=64, max_num_seqs=8)
    cases = [
        ({}, "it sizes the pool on CUDA only; on cpu kv_cache_bytes does (default 1024 MiB)"),
        ({"kv_cache_bytes": 2_000_000}, "kv_cache_bytes sets the pool"),
        ({"num_kv_blocks": 100}, "num_kv_blocks sets the pool"),
    ]
    for extra, why in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvbatch.engine.kv.sizing"):
            asked = LLM(path, kv_cache_memory_fraction=0.5, **args, **extra)
        assert f"kv_cache_memory_fraction=0.5 is not used: {why}" in caplog.text
        default = LLM(path, **args, **extra)
        assert asked.engine.kv.num_blocks == default.engine.kv.num_blocks
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvbatch.engine.kv.sizing"):
        LLM(path, **args)
    assert "kv_cache_memory_fraction" not in caplog.text

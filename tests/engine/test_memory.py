"""The KV pool's size: a default budget is capped at what requests can put to use; an explicit
one is not. (The CUDA profile itself runs in tests/engine/test_triton_backend.py and on the GPU
check.)"""

from __future__ import annotations

import logging

import torch

from engine import LLM
from engine.memory import KV_POOL_REQUESTS_PER_SEQ, kv_blocks_worth_having
from engine.runner import kv_bytes_per_block


def test_blocks_worth_having_counts_full_length_requests():
    assert kv_blocks_worth_having(8, 64, 16) == KV_POOL_REQUESTS_PER_SEQ * 8 * 4
    assert kv_blocks_worth_having(1, 65, 16) == KV_POOL_REQUESTS_PER_SEQ * 5  # a partial block


def test_a_default_budget_is_capped_and_says_so(tiny_models, caplog):
    """The CPU's default 1 GiB holds ~260k blocks of the tiny model; 8 requests of 64 tokens
    can use 4 x 8 x 4 of them."""
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
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

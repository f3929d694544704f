"""The two attention backends on one step with an FP8 cache: the same writes and the same
outputs, and both equal attention over the dequantized cache (every query, its own chunk's
included, sees K/V as the cache holds them).

The step: two decodes and two prefill chunks (one after a cached prefix, one from scratch),
blocks in shuffled order, per-layer scales that are not 1.
"""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.attention.kv_scales import KVScales
from kvbatch.engine.attention.metadata import AttentionMetadata, PrefillSpan
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend
from kvbatch.engine.attention.triton_backend import TritonAttentionBackend
from kvbatch.kernels.kv_quant import dequantize_kv, quantize_kv, round_trip_kv

BLOCK, KV_HEADS, HEADS, DIM, NUM_BLOCKS = 8, 2, 4, 16, 24
SCALES = KVScales(k=0.3, v=1.7)


def step(gen: torch.Generator) -> tuple[AttentionMetadata, int]:
    """Decodes of 13 and 20 context tokens, chunks of 5 (after 11 cached) and 9 (nothing
    cached); returns the metadata and the step's token count."""
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()

    def blocks(n: int) -> torch.Tensor:
        return torch.tensor([perm.pop() for _ in range(-(-n // BLOCK))])

    def slot(table: torch.Tensor, pos: int) -> int:
        return int(table[pos // BLOCK]) * BLOCK + pos % BLOCK

    d0, d1, p0, p1 = blocks(13), blocks(20), blocks(16), blocks(9)
    slots = [slot(d0, 12), slot(d1, 19)]
    slots += [slot(p0, 11 + i) for i in range(5)] + [slot(p1, i) for i in range(9)]
    tables = torch.zeros(2, 3, dtype=torch.long)
    tables[0, :2], tables[1, :3] = d0, d1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=2,
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor([13, 20]),
        prefills=[PrefillSpan(2, 5, 16, p0), PrefillSpan(7, 9, 9, p1)],
    )
    return meta, len(slots)


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(3)
    meta, tokens = step(gen)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=gen) * 2
    v = torch.randn(tokens, KV_HEADS, DIM, generator=gen)
    old = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM, generator=gen)  # earlier steps' K/V
    cache = torch.stack([quantize_kv(old[0], SCALES.k), quantize_kv(old[1], SCALES.v)])
    return meta, q, k, v, cache


def test_both_backends_write_and_read_fp8_alike(inputs):
    """(On the CPU the triton backend runs under TRITON_INTERPRET=1, as tests/conftest.py sets.)"""
    meta, q, k, v, cache = inputs
    torch_cache, triton_cache = cache.clone(), cache.clone()

    out_torch = TorchAttentionBackend().forward(q, k, v, torch_cache, meta, SCALES)
    out_triton = TritonAttentionBackend().forward(q, k, v, triton_cache, meta, SCALES)

    assert torch.equal(torch_cache.float(), triton_cache.float())
    assert not torch.equal(torch_cache.float(), cache.float())  # the step was written
    torch.testing.assert_close(out_triton, out_torch, atol=1e-4, rtol=1e-4)


def test_fp8_equals_float_attention_over_the_dequantized_cache(inputs):
    """The FP8 path is attention over the dequantized cache with round-tripped new K/V."""
    meta, q, k, v, cache = inputs
    out = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta, SCALES)

    float_cache = torch.stack(
        [dequantize_kv(cache[0], SCALES.k, q.dtype), dequantize_kv(cache[1], SCALES.v, q.dtype)]
    )
    k_seen, v_seen = round_trip_kv(k, SCALES.k), round_trip_kv(v, SCALES.v)
    expected = TorchAttentionBackend().forward(q, k_seen, v_seen, float_cache, meta)

    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # and scales matter: the same bytes read with unit scales give other outputs
    wrong = TorchAttentionBackend().forward(q, k, v, cache.clone(), meta)
    assert (wrong - out).abs().max() > 0.1

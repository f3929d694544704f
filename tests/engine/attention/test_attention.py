"""The torch (reference, CPU) backend's decode: rows of very different lengths in buckets."""

from __future__ import annotations

import pytest
import torch

import kvbatch.engine.attention.torch_backend as attention
from kvbatch.engine.attention.metadata import AttentionMetadata
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend, length_buckets

BLOCK = 16


def decode_meta(lens: list[int], num_blocks: int) -> AttentionMetadata:
    """Decode rows with their own blocks, tables padded with block 0, in a shuffled pool."""
    g = torch.Generator().manual_seed(len(lens))
    pool = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // BLOCK) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        need = -(-n // BLOCK)
        tables[i, :need] = torch.tensor([pool.pop() for _ in range(need)])
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor(lens),
        prefills=[],
    )


def row_by_row(q, cache, meta):
    """Each row alone over exactly its own keys: softmax(q k / sqrt(d)) v, heads sharing kv
    heads in groups."""
    heads, kv_heads = q.shape[1], cache.shape[3]
    out = torch.empty_like(q)
    for i, n in enumerate(meta.decode_seq_lens.tolist()):
        blocks = meta.decode_block_tables[i, : -(-n // BLOCK)]
        k = cache[0][blocks].reshape(-1, kv_heads, q.shape[2])[:n]
        v = cache[1][blocks].reshape(-1, kv_heads, q.shape[2])[:n]
        k = k.repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, d]
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i], k) / q.shape[2] ** 0.5
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize(
    "lens,split",
    [
        ([60] * 8 + [2048], True),  # a long prompt's first decode among short ones
        ([17, 33, 70, 129, 260, 1000, 2001, 5, 3], True),  # one row per octave
        ([100] * 32 + [250] * 32, True),  # two octaves, enough padding saved to split
        ([40, 50, 61, 79], False),  # within 2x: one call
    ],
    ids=["outlier", "every-octave", "two-octaves", "one-call"],
)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_decode_equals_each_row_alone(lens, split, heads, kv_heads):
    head_dim, num_blocks = 16, 1200
    assert (length_buckets(torch.tensor(lens)) is not None) == split
    meta = decode_meta(lens, num_blocks)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    got = TorchAttentionBackend._decode(q, cache, meta)
    torch.testing.assert_close(got, row_by_row(q, cache, meta), atol=1e-5, rtol=1e-5)


def test_buckets_pad_no_row_past_twice_its_length():
    lens = torch.tensor([17, 33, 70, 129, 260, 1000, 2001, 5, 3])
    buckets = length_buckets(lens)
    assert buckets is not None
    rows = sorted(i for b in buckets for i in b.tolist())
    assert rows == list(range(len(lens)))  # every row once
    for b in buckets:
        assert int(lens[b].max()) < 2 * int(lens[b].min())


@pytest.mark.parametrize(
    "lens",
    [[500] * 8, [40, 50, 61, 79], [60, 130, 300], [7]],
    ids=["equal", "within-2x", "little-saved", "one-row"],
)
def test_one_call_when_buckets_would_not_pay(lens):
    """An SDPA call per bucket costs more than a little padding: [60, 130, 300] pads 410 keys,
    under MIN_PADDED_KEYS_SAVED."""
    assert length_buckets(torch.tensor(lens)) is None


def test_a_long_row_among_short_ones_gets_its_own_bucket(monkeypatch):
    lens = torch.tensor([60] * 8 + [2048])
    buckets = length_buckets(lens)
    assert [b.tolist() for b in buckets] == [list(range(8)), [8]]
    # and the bucketed result is the single padded call's
    meta = decode_meta(lens.tolist(), 200)
    cache = torch.randn(2, 200, BLOCK, 2, 16)
    q = torch.randn(9, 4, 16)
    bucketed = TorchAttentionBackend._decode(q, cache, meta)
    monkeypatch.setattr(attention, "length_buckets", lambda lens: None)
    torch.testing.assert_close(bucketed, TorchAttentionBackend._decode(q, cache, meta))

"""The attention kernels with layer variants (sliding window, soft-cap, another scale) against
their torch references, under the interpreter on the CPU: prefill chunks after a cached prefix
longer than the window, split keys, decode rows in splits, and cascade-shaped non-causal
groups whose rows' windows end inside or before the shared keys."""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from kvbatch.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from tests.kernels.conftest import (
    assert_close,
    assert_lse_close,
    generator,
    make_paged_kv,
    poisoned,
    randn,
)

VARIANTS = {
    "window-1": dict(sliding_window=1),
    "window-7": dict(sliding_window=7),
    "window-40": dict(sliding_window=40),
    "capped": dict(softcap=0.8, scale=0.3),
    "window-capped": dict(sliding_window=20, softcap=1.5),
}


@pytest.mark.parametrize("num_splits", [None, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_causal_prefill(variant, num_splits, dtype, device):
    gen = generator(0)
    chunks = [(9, 100), (33, 33), (1, 50), (20, 70)]  # (query_len, context_len)
    query_lens, context_lens = [q for q, _ in chunks], [c for _, c in chunks]
    starts = [sum(query_lens[:i]) for i in range(len(chunks))]
    kv_cache, tables = make_paged_kv(
        context_lens, block_size=8, num_kv_heads=2, head_dim=32, dtype=dtype, device=device, gen=gen
    )
    q = randn(sum(query_lens), 8, 32, gen=gen, dtype=dtype, device=device)
    meta = [torch.tensor(x, device=device) for x in (starts, query_lens, context_lens)]
    kw = dict(return_lse=True, **variant)
    out, lse = paged_prefill_attention(
        q, kv_cache, tables, *meta, max(query_lens), out=poisoned(q), num_splits=num_splits, **kw
    )
    ref, ref_lse = paged_prefill_attention_ref(q, kv_cache, tables, *meta, max(query_lens), **kw)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_noncausal_groups_with_each_rows_position(variant, dtype, device):
    """Cascade's shape: rows of a group sit after the shared keys at their private lengths;
    with a window of 7, rows 10 and more past the shared keys see none of them (lse -inf)."""
    gen = generator(1)
    chunks = [(4, 48), (3, 16)]  # (rows in the group, shared keys)
    query_lens, context_lens = [q for q, _ in chunks], [c for _, c in chunks]
    kv_cache, tables = make_paged_kv(
        context_lens, block_size=8, num_kv_heads=1, head_dim=16, dtype=dtype, device=device, gen=gen
    )
    q = randn(7, 4, 16, gen=gen, dtype=dtype, device=device)
    meta = [torch.tensor(x, device=device) for x in ([0, 4], query_lens, context_lens)]
    offsets = torch.tensor([1, 5, 12, 30, 2, 8, 3], device=device)
    kw = dict(causal=False, return_lse=True, row_offsets=offsets, **variant)
    out, lse = paged_prefill_attention(q, kv_cache, tables, *meta, 4, out=poisoned(q), **kw)
    ref, ref_lse = paged_prefill_attention_ref(q, kv_cache, tables, *meta, 4, **kw)
    seen = ref_lse > float("-inf")
    assert_close(out[seen.all(-1)], ref[seen.all(-1)], dtype)
    assert_lse_close(lse, ref_lse)
    if variant.get("sliding_window") == 7:
        assert not seen[2:4].any() and seen[:2].all()


def test_noncausal_window_without_row_positions_is_refused(device):
    q = torch.zeros(2, 2, 16, device=device)
    kv_cache = torch.zeros(2, 4, 8, 1, 16, device=device)
    one = torch.tensor([0], device=device)
    with pytest.raises(ValueError, match="needs row_offsets"):
        paged_prefill_attention(
            q, kv_cache, one[None], one, one + 2, one + 8, 2, causal=False, sliding_window=4
        )


@pytest.mark.parametrize("num_splits", [None, 4], ids=["auto-splits", "4-splits"])
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_decode(variant, num_splits, dtype, device):
    gen = generator(2)
    seq_lens = [1, 7, 40, 130, 300]
    kv_cache, tables = make_paged_kv(
        seq_lens, block_size=16, num_kv_heads=2, head_dim=32, dtype=dtype, device=device, gen=gen
    )
    q = randn(len(seq_lens), 4, 32, gen=gen, dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, device=device)
    kw = dict(return_lse=True, num_splits=num_splits, **variant)
    out, lse = paged_decode_attention(q, kv_cache, tables, lens, out=poisoned(q), **kw)
    ref, ref_lse = paged_decode_attention_ref(q, kv_cache, tables, lens, **kw)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse)

"""paged_prefill_attention (Triton) against its torch reference, and the reference against SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvbatch.kernels.prefill_attention import (
    MIN_KEYS_PER_SPLIT,
    auto_prefill_splits,
    choose_prefill_splits,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from tests.kernels.conftest import (
    assert_close,
    assert_lse_close,
    gather_context,
    generator,
    make_paged_kv,
    poisoned,
    randn,
)


@dataclass
class Case:
    chunks: list[tuple[int, int]]  # (query_len, context_len) per sequence
    group: int  # query heads per kv head
    head_dim: int
    causal: bool = True
    num_kv_heads: int = 2
    block_size: int = 16
    table_dtype: torch.dtype = torch.int64


CASES = {
    # whole prompts (no cached prefix): 1 token, one exact block, odd lengths; and a chunk
    # whose first row sees exactly 63 keys (one short of the kernel's key tile)
    "mha-d64-prompts": Case([(1, 1), (16, 16), (37, 37), (5, 5), (10, 72)], group=1, head_dim=64),
    # chunks after a cached prefix (chunked prefill / prefix-cache hits), int32 tables
    "gqa4-d128-cached": Case(
        [(33, 65), (64, 64), (3, 200)], group=4, head_dim=128, table_dtype=torch.int32
    ),
    # GQA 8, head_dim 16, blocks of 8: chunks span several row tiles and ~20 blocks; a row
    # tile whose first row sees exactly one key tile (64 keys)
    "gqa8-d16-multitile": Case(
        [(70, 150), (70, 117), (17, 49), (1, 8)], group=8, head_dim=16, num_kv_heads=1, block_size=8
    ),
    # cascade shape: groups of decoding rows against shared prefixes (one of them empty)
    "gqa4-d64-noncausal": Case(
        [(6, 48), (1, 17), (3, 0), (20, 100)], group=4, head_dim=64, causal=False
    ),
    # short chunks after long contexts (the long-prefill shape): few row tiles, so the keys
    # are split across programs by default; a short sequence beside them has empty splits
    "gqa4-d64-long-context": Case(
        [(9, 1100), (40, 1500), (2, 30)], group=4, head_dim=64, num_kv_heads=1
    ),
}


def auto_splits(case: Case, dtype: torch.dtype, device: torch.device) -> int:
    """The split count the kernel picks by itself for this case (as the test launches it)."""
    max_query_len = max(q for q, _ in case.chunks) + 5
    dims = (case.head_dim, case.group, max_query_len, len(case.chunks), case.num_kv_heads)
    return auto_prefill_splits(dtype, *dims, max(c for _, c in case.chunks), device)


@pytest.mark.parametrize("num_splits", [None, 3, 7], ids=["auto-splits", "3-splits", "7-splits"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_prefill_matches_reference(
    case: Case, num_splits: int | None, dtype: torch.dtype, device: torch.device
):
    gen = generator(0)
    query_lens = [q for q, _ in case.chunks]
    context_lens = [c for _, c in case.chunks]
    # Sequences' rows in q with gaps between them (and after): rows outside every sequence
    # must stay untouched.
    starts, row = [], 2
    for n in query_lens:
        starts.append(row)
        row += n + 3
    num_tokens, heads = row, case.num_kv_heads * case.group
    kv_cache, tables = make_paged_kv(
        context_lens,
        block_size=case.block_size,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        dtype=dtype,
        device=device,
        gen=gen,
        table_dtype=case.table_dtype,
    )
    q = randn(num_tokens, heads, case.head_dim, gen=gen, dtype=dtype, device=device)
    meta = [torch.tensor(x, device=device) for x in (starts, query_lens, context_lens)]
    max_query_len = max(query_lens) + 5  # the grid may be sized generously

    out, lse = paged_prefill_attention(
        q,
        kv_cache,
        tables,
        *meta,
        max_query_len,
        causal=case.causal,
        out=poisoned(q),
        return_lse=True,
        max_context_len=max(context_lens),
        num_splits=num_splits,
    )
    ref_out, ref_lse = paged_prefill_attention_ref(
        q,
        kv_cache,
        tables,
        *meta,
        max_query_len,
        causal=case.causal,
        out=poisoned(q),
        return_lse=True,
    )

    covered = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    for start, n in zip(starts, query_lens):
        covered[start : start + n] = True
    assert not out[covered].isnan().any(), "some covered rows were not written"
    assert out[~covered].isnan().all(), "rows outside every sequence were written"
    assert_close(out[covered], ref_out[covered], dtype)
    assert_lse_close(lse, ref_lse)
    assert (lse[~covered] == float("-inf")).all()


def test_prefill_without_lse_allocates_output(device: torch.device):
    gen = generator(1)
    kv_cache, tables = make_paged_kv(
        [20],
        block_size=16,
        num_kv_heads=1,
        head_dim=32,
        dtype=torch.float32,
        device=device,
        gen=gen,
    )
    q = randn(20, 2, 32, gen=gen, dtype=torch.float32, device=device)
    meta = [torch.tensor([x], device=device) for x in (0, 20, 20)]
    out = paged_prefill_attention(q, kv_cache, tables, *meta, 20, scale=0.2)
    assert isinstance(out, torch.Tensor)
    expected = paged_prefill_attention_ref(q, kv_cache, tables, *meta, 20, scale=0.2)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_sdpa(causal: bool, device: torch.device):
    """The reference against dense SDPA on K/V gathered independently (a chunk after a cached
    prefix: query i sits at position cached + i)."""
    gen = generator(2)
    query_len, context_len, kv_heads, group, head_dim = 13, 45, 2, 4, 32
    kv_cache, tables = make_paged_kv(
        [context_len], block_size=8, num_kv_heads=kv_heads, head_dim=head_dim,
        dtype=torch.float32, device=device, gen=gen,
    )  # fmt: skip
    q = randn(query_len, kv_heads * group, head_dim, gen=gen, dtype=torch.float32, device=device)
    meta = [torch.tensor([x], device=device) for x in (0, query_len, context_len)]
    out = paged_prefill_attention_ref(q, kv_cache, tables, *meta, query_len, causal=causal)

    k, v = gather_context(kv_cache, tables[0], context_len)
    mask = None
    if causal:
        q_pos = torch.arange(context_len - query_len, context_len, device=device)
        mask = torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_long_context_case_splits_by_default(dtype: torch.dtype, device: torch.device):
    """The long-context case above really takes the split path when left to choose."""
    assert auto_splits(CASES["gqa4-d64-long-context"], dtype, device) > 1
    assert auto_splits(CASES["mha-d64-prompts"], dtype, device) == 1  # contexts too short


def test_choose_prefill_splits(device: torch.device):
    assert choose_prefill_splits(64, None, device) == 1  # longest context unknown: no split
    assert choose_prefill_splits(64, 100, device) == 1  # below MIN_KEYS_PER_SPLIT per split
    few = choose_prefill_splits(64, 32768, device)  # a 256-token chunk of a 32k prompt
    assert 2 <= few <= 32768 // MIN_KEYS_PER_SPLIT
    assert choose_prefill_splits(64, 3 * MIN_KEYS_PER_SPLIT, device) == min(3, few)
    assert choose_prefill_splits(100_000, 32768, device) == 1  # tiles already fill the GPU
    if device.type == "cpu":  # the interpreter counts 132 SMs, as the H200: the splits that
        # measured fastest there (scripts/prefill_split_bench.py), never a second wave
        chunks = {128: 32, 256: 64, 512: 128, 2048: 512}  # chunk tokens: row-tile programs
        got = {c: choose_prefill_splits(p, 32768, device) for c, p in chunks.items()}
        assert got == {128: 8, 256: 4, 512: 2, 2048: 1}


def test_split_count_must_be_positive(device: torch.device):
    gen = generator(3)
    kv_cache, tables = make_paged_kv(
        [20], block_size=16, num_kv_heads=1, head_dim=32, dtype=torch.float32, device=device,
        gen=gen,
    )  # fmt: skip
    q = randn(20, 2, 32, gen=gen, dtype=torch.float32, device=device)
    meta = [torch.tensor([x], device=device) for x in (0, 20, 20)]
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        paged_prefill_attention(q, kv_cache, tables, *meta, 20, num_splits=0)

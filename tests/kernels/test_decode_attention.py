"""paged_decode_attention (Triton) against its torch reference, and the reference against SDPA."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kvbatch.kernels.decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
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
    seq_lens: list[int]
    group: int  # query heads per kv head
    head_dim: int
    num_kv_heads: int = 2
    block_size: int = 16
    num_splits: int | None = None
    table_dtype: torch.dtype = torch.int64
    scale: float | None = None
    spare_columns: int = 1  # table columns past the longest row (padding)


CASES = {
    # odd lengths, exact block boundaries, an empty padding row, one split (auto)
    "mha-d64": Case([0, 1, 16, 33, 100], group=1, head_dim=64),
    # GQA 4, wide heads, splits that end mid-block, int32 tables
    "gqa4-d128-splits3": Case(
        [64, 5, 0, 129], group=4, head_dim=128, num_splits=3, table_dtype=torch.int32
    ),
    # GQA 8 with the tiny models' head_dim 16, small blocks, contexts of ~40 blocks; the
    # longest row fills its table to the last slot (no padding column)
    "gqa8-d16-long": Case(
        [304, 7, 8, 0, 250],
        group=8,
        head_dim=16,
        num_kv_heads=1,
        block_size=8,
        num_splits=4,
        spare_columns=0,
    ),
    # more splits than the context fills: trailing splits are empty; a custom scale
    "gqa4-d64-empty-splits": Case(
        [31, 32, 33, 90], group=4, head_dim=64, block_size=32, num_splits=16, scale=0.3
    ),
    # a wide table (one context past LONG_TABLE_TOKENS beside short ones): the automatic
    # choice cuts it into 5 splits, and the short rows' other splits are empty
    "gqa4-d16-wide-auto": Case(
        [8300, 3, 0, 700], group=4, head_dim=16, num_kv_heads=1, block_size=64
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decode_matches_reference(case: Case, dtype: torch.dtype, device: torch.device):
    gen = generator(0)
    batch, heads = len(case.seq_lens), case.num_kv_heads * case.group
    kv_cache, tables = make_paged_kv(
        case.seq_lens,
        block_size=case.block_size,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        dtype=dtype,
        device=device,
        gen=gen,
        table_dtype=case.table_dtype,
        spare_columns=case.spare_columns,
    )
    # q as the runner has it: a strided view into a fused qkv projection
    qkv = randn(
        batch, heads + 2 * case.num_kv_heads, case.head_dim, gen=gen, dtype=dtype, device=device
    )
    q = qkv[:, :heads]
    seq_lens = torch.tensor(case.seq_lens, device=device)
    kwargs = dict(scale=case.scale, return_lse=True)

    out, lse = paged_decode_attention(
        q, kv_cache, tables, seq_lens, out=poisoned(q), num_splits=case.num_splits, **kwargs
    )
    ref_out, ref_lse = paged_decode_attention_ref(q, kv_cache, tables, seq_lens, **kwargs)

    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (batch, heads)
    assert not out.isnan().any(), "some output elements were never written"
    assert_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse)
    empty = seq_lens == 0
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()


def test_decode_without_lse_allocates_output(device: torch.device):
    gen = generator(1)
    kv_cache, tables = make_paged_kv(
        [40, 3],
        block_size=16,
        num_kv_heads=2,
        head_dim=32,
        dtype=torch.float32,
        device=device,
        gen=gen,
    )
    q = randn(2, 4, 32, gen=gen, dtype=torch.float32, device=device)
    seq_lens = torch.tensor([40, 3], device=device)
    out = paged_decode_attention(q, kv_cache, tables, seq_lens)
    assert isinstance(out, torch.Tensor)
    assert_close(out, paged_decode_attention_ref(q, kv_cache, tables, seq_lens), torch.float32)


def test_reference_matches_sdpa(device: torch.device):
    """The reference against dense SDPA on K/V gathered independently, row by row."""
    gen = generator(2)
    seq_lens, kv_heads, group, head_dim = [37, 16, 1], 2, 4, 64
    kv_cache, tables = make_paged_kv(
        seq_lens, block_size=8, num_kv_heads=kv_heads, head_dim=head_dim,
        dtype=torch.float32, device=device, gen=gen,
    )  # fmt: skip
    q = randn(
        len(seq_lens), kv_heads * group, head_dim, gen=gen, dtype=torch.float32, device=device
    )
    out = paged_decode_attention_ref(q, kv_cache, tables, torch.tensor(seq_lens, device=device))
    for b, n in enumerate(seq_lens):
        k, v = gather_context(kv_cache, tables[b], n)  # [n, kv_heads, D]
        expected = F.scaled_dot_product_attention(
            q[b, :, None, :], k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)


def test_num_splits_from_shapes_only():
    cpu = torch.device("cpu")
    assert choose_num_splits(512, 8, 80 * 16, cpu) == 1  # the big batch fills the GPU alone
    assert choose_num_splits(1, 8, 2048 * 16, cpu) > 8  # one long sequence needs splits
    assert choose_num_splits(1, 8, 64, cpu) == 1  # too short to be worth splitting
    assert choose_num_splits(256, 8, 8192, cpu) == 1  # a graph's usual table: the batch fills
    # a wide table (a 32k context among 72 rows): splits of <= 2048 tokens all the same
    assert choose_num_splits(72, 8, 2049 * 16, cpu) == 17


@pytest.mark.gpu
def test_decode_in_cuda_graph():
    """Captured once, replayed with other seq_lens (including 0): shapes fixed, lengths not."""
    device = torch.device("cuda")
    gen = generator(3)
    lens = [200, 1, 64, 0, 150, 3000, 17, 48]
    kv_cache, tables = make_paged_kv(
        lens,
        block_size=16,
        num_kv_heads=8,
        head_dim=64,
        dtype=torch.bfloat16,
        device=device,
        gen=gen,
    )
    q = randn(len(lens), 32, 64, gen=gen, dtype=torch.bfloat16, device=device)
    seq_lens = torch.zeros(len(lens), dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    paged_decode_attention(q, kv_cache, tables, seq_lens, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, kv_cache, tables, seq_lens, out=out)
    for replay_lens in (lens, [1, 0, 2, 0, 16, 1500, 33, 1]):
        seq_lens.copy_(torch.tensor(replay_lens, device=device))
        graph.replay()
        assert_close(out, paged_decode_attention_ref(q, kv_cache, tables, seq_lens), torch.bfloat16)

"""mla_decode_attention (Triton) and its torch reference against absorbed MLA decode computed
here in float64, row by row from the paged latent cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import triton.language as tl

from kvbatch.kernels.interpreter import interpreting
from kvbatch.kernels.mla_attention import mla_decode_attention, mla_decode_attention_ref
from tests.kernels.conftest import (
    TOLERANCES,
    assert_close,
    assert_lse_close,
    generator,
    poisoned,
    randn,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def bf16_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter hands bfloat16 tiles to np.matmul as their uint16 storage, so a
    bfloat16 tl.dot returns nonsense on the CPU. Widen them to float32 first, which is what
    tensor cores compute (exact bfloat16 products, float32 sums); loads, casts and stores in
    bfloat16 run unchanged. On CUDA this does nothing."""
    if not interpreting():
        return
    from triton.runtime.interpreter import InterpreterBuilder

    create_dot = InterpreterBuilder.create_dot

    def widened(self, a, b, d, *args):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return create_dot(self, a, b, d, *args)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", widened)


@dataclass
class Case:
    seq_lens: list[int]
    heads: int = 8
    latent: int = 32  # R, kv_lora_rank
    rope: int = 16  # P, qk_rope_head_dim
    block_size: int = 8
    num_splits: int | None = None
    spare_columns: int = 1  # table columns past the longest row (padding)
    pad_width: int = 0  # cache elements past R + P in each token's row
    pad_slots: int = 0  # token rows past block_size in each block: a larger block stride


CASES = {
    # one token, exactly a block, a few blocks and a partial one; one split
    "short-one-split": Case([1, 8, 37, 3], num_splits=1),
    # rows of very different lengths (1 to ~34 blocks), 3 splits that end mid-block
    "ragged-splits3": Case([270, 1, 16, 100], num_splits=3),
    # more splits than the longest row fills: trailing splits are empty for every row
    "empty-splits": Case([9, 24, 2], num_splits=12, block_size=4),
    # the automatic choice splits a 600-token table in two; the 1-token row's second is empty
    "auto-splits": Case([600, 1, 64], block_size=16, spare_columns=0),
    # heads over two tiles (20 = 16 + 4), a cache that is a strided view of a larger buffer,
    # widths not powers of two (R 24, P 8)
    "heads20-strided": Case(
        [33, 7], heads=20, latent=24, rope=8, num_splits=2, pad_width=5, pad_slots=3
    ),
    # DeepSeek-V3's widths (R 512, P 64) on one tile of 16 heads
    "deepseek-widths": Case([5, 40], heads=16, latent=512, rope=64, block_size=16),
}


def make_latent_cache(case: Case, dtype: torch.dtype, gen: torch.Generator):
    """A random latent cache [num_blocks, block_size, R + P] (a view into a larger buffer when
    the case pads) and shuffled int32 block tables [B, max_blocks]. Every slot no row may read
    (the tail of a row's last block, blocks nobody owns, padding columns' targets) holds NaN:
    a kernel that lets one into its sums returns NaN."""
    bs, width = case.block_size, case.latent + case.rope
    needed = [-(-n // bs) for n in case.seq_lens]
    num_blocks = sum(needed) + 3
    max_blocks = max(needed) + case.spare_columns
    base = torch.full((num_blocks, bs + case.pad_slots, width + case.pad_width), float("nan"))
    cache = base[:, :bs, :width]
    perm = torch.randperm(num_blocks, generator=gen)
    unowned = perm[sum(needed) :]
    tables = unowned[torch.randint(0, len(unowned), (len(needed), max_blocks), generator=gen)]
    used = 0
    for row, (n, blocks) in enumerate(zip(case.seq_lens, needed, strict=True)):
        tables[row, :blocks] = perm[used : used + blocks]
        used += blocks
        positions = torch.arange(n)
        ids = tables[row, positions // bs]
        cache[ids, positions % bs] = torch.randn(n, width, generator=gen)
    return base.to(dtype)[:, :bs, :width], tables.to(torch.int32)


def make_queries(case: Case, dtype: torch.dtype, gen: torch.Generator):
    """q_latent [B, H, R] and q_rope [B, H, P] as the model has them: two views of one
    [B, H, R + P] tensor (strided along heads)."""
    shape = (len(case.seq_lens), case.heads, case.latent + case.rope)
    q = randn(*shape, gen=gen, dtype=dtype, device=torch.device("cpu"))
    return q[..., : case.latent], q[..., case.latent :]


def absorbed_decode_f64(q_latent, q_rope, cache, tables, seq_lens, scale):
    """The definition, in float64, one row at a time over that row's own tokens."""
    batch, heads, latent = q_latent.shape
    bs = cache.shape[1]
    out = torch.zeros(batch, heads, latent, dtype=torch.float64)
    lse = torch.full((batch, heads), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(seq_lens):
        if n == 0:
            continue
        positions = torch.arange(n)
        context = cache[tables[b].long()[positions // bs], positions % bs].double()  # [n, R + P]
        c_kv, k_rope = context[:, :latent], context[:, latent:]
        scores = (q_latent[b].double() @ c_kv.T + q_rope[b].double() @ k_rope.T) * scale
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.softmax(scores, dim=-1) @ c_kv
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_matches_float64(case: Case, dtype: torch.dtype, bf16_dots, device):
    gen = generator(0)
    cache, tables = make_latent_cache(case, dtype, gen)
    q_latent, q_rope = make_queries(case, dtype, gen)
    scale = (case.latent + case.rope) ** -0.5
    expected, expected_lse = absorbed_decode_f64(
        q_latent, q_rope, cache, tables, case.seq_lens, scale
    )
    q_latent, q_rope, cache, tables = (t.to(device) for t in (q_latent, q_rope, cache, tables))
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)

    out, lse = mla_decode_attention(
        q_latent, q_rope, cache, tables, seq_lens, scale,
        num_splits=case.num_splits, out=poisoned(q_latent), return_lse=True,
    )  # fmt: skip

    assert out.shape == q_latent.shape and out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN: a slot past a row's length was read, or out not written"
    assert_close(out.cpu(), expected, dtype)
    assert_lse_close(lse.cpu(), expected_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_reference_matches_float64(dtype: torch.dtype):
    """The torch reference (the CPU path) on the same NaN-poisoned caches, splits ignored."""
    for case in CASES.values():
        gen = generator(1)
        cache, tables = make_latent_cache(case, dtype, gen)
        q_latent, q_rope = make_queries(case, dtype, gen)
        seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
        scale = 0.7 * (case.latent + case.rope) ** -0.5
        out, lse = mla_decode_attention_ref(
            q_latent, q_rope, cache, tables, seq_lens, scale, return_lse=True
        )
        expected, expected_lse = absorbed_decode_f64(
            q_latent, q_rope, cache, tables, case.seq_lens, scale
        )
        assert out.dtype == dtype and not out.isnan().any()
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
        torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-5)


def test_empty_row_and_default_output(device):
    """A row of length 0 (a padding row of a graph batch) gives zeros and lse -inf; without
    `out` and `return_lse` the kernel allocates and returns the output alone."""
    case = Case([0, 12], heads=4)
    gen = generator(2)
    cache, tables = make_latent_cache(case, torch.float32, gen)
    q_latent, q_rope = make_queries(case, torch.float32, gen)
    args = [t.to(device) for t in (q_latent, q_rope, cache, tables)]
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    out, lse = mla_decode_attention(*args, seq_lens, 0.2, return_lse=True)
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    plain = mla_decode_attention(*args, seq_lens, 0.2)
    assert isinstance(plain, torch.Tensor)
    expected, _ = absorbed_decode_f64(q_latent, q_rope, cache, tables, case.seq_lens, 0.2)
    assert_close(plain.cpu(), expected, torch.float32)


def test_mismatched_inputs_are_refused():
    q_latent, q_rope = torch.zeros(2, 4, 32), torch.zeros(2, 4, 16)
    tables, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_lora_rank \\+ qk_rope_head_dim = 48"):
        mla_decode_attention(q_latent, q_rope, torch.zeros(5, 8, 40), tables, lens, 1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        mla_decode_attention(q_latent, q_rope, torch.zeros(5, 8, 48).half(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(5, 8, 96)[..., ::2]
        mla_decode_attention(q_latent, q_rope, strided, tables, lens, 1.0)


@pytest.mark.gpu
def test_deepseek_shapes_in_cuda_graph():
    """DeepSeek-V3's shapes (128 heads, R 512, P 64, bf16) with a long row beside short ones,
    captured once and replayed with other lengths: shapes fixed, lengths not."""
    device = torch.device("cuda")
    case = Case([3000, 1, 64, 700, 17], heads=128, latent=512, rope=64, block_size=64)
    gen = generator(3)
    cache, tables = make_latent_cache(case, torch.bfloat16, gen)
    cache = cache.nan_to_num()  # replays read other slots than the NaN-free ones of this case
    q_latent, q_rope = make_queries(case, torch.bfloat16, gen)
    q_latent, q_rope, cache, tables = (t.to(device) for t in (q_latent, q_rope, cache, tables))
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=device)
    out = torch.empty_like(q_latent)
    args = (q_latent, q_rope, cache, tables, seq_lens, 192**-0.5)
    mla_decode_attention(*args, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_attention(*args, out=out)
    for lens in (case.seq_lens, [1, 1, 2, 3000, 0]):
        seq_lens.copy_(torch.tensor(lens, device=device))
        graph.replay()
        assert_close(out, mla_decode_attention_ref(*args), torch.bfloat16)

"""merge_attention_states (Triton) against its reference; the reference against full attention;
and cascade attention built from the three kernels against plain decode."""

from __future__ import annotations

import torch

from kvbatch.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from kvbatch.kernels.merge_states import merge_attention_states, merge_attention_states_ref
from kvbatch.kernels.prefill_attention import paged_prefill_attention
from tests.kernels.conftest import (
    assert_close,
    assert_lse_close,
    generator,
    make_paged_kv,
    poisoned,
    randn,
)

NEG_INF = float("-inf")


def test_merge_matches_reference(dtype: torch.dtype, device: torch.device):
    gen = generator(0)
    rows, heads, head_dim = 9, 20, 40  # heads over two programs, head_dim not a power of 2
    out_a = randn(rows, heads, head_dim, gen=gen, dtype=dtype, device=device)
    out_b = randn(rows, heads, head_dim, gen=gen, dtype=dtype, device=device)
    lse_a = (torch.randn(rows, heads, generator=gen) * 5).to(device)
    lse_b = (torch.randn(rows, heads, generator=gen) * 5).to(device)
    # Empty sides (lse -inf) whose outputs are garbage: a side only, b side only, both.
    lse_a[0], out_a[0] = NEG_INF, float("nan")
    lse_b[1], out_b[1] = NEG_INF, float("nan")
    lse_a[2, :3] = lse_b[2, :3] = NEG_INF
    out_a[2, :3] = out_b[2, :3] = float("nan")

    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b, out=poisoned(out_a))
    ref_out, ref_lse = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any()
    assert_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse)
    assert torch.equal(out[0], out_b[0]) and torch.equal(out[1], out_a[1])  # returned as is
    assert (out[2, :3] == 0).all() and (lse[2, :3] == NEG_INF).all()


def test_merge_in_place(device: torch.device):
    gen = generator(1)
    out_a = randn(4, 3, 16, gen=gen, dtype=torch.float32, device=device)
    out_b = randn(4, 3, 16, gen=gen, dtype=torch.float32, device=device)
    lse_a, lse_b = (
        torch.randn(4, 3, generator=gen).to(device),
        torch.randn(4, 3, generator=gen).to(device),
    )
    expected, _ = merge_attention_states_ref(out_a, lse_a, out_b, lse_b)
    out, _ = merge_attention_states(out_a, lse_a, out_b, lse_b, out=out_a)
    assert out.data_ptr() == out_a.data_ptr()
    assert_close(out_a, expected, torch.float32)


def _attend(q, k, v):  # [N, H, D] x [S, H, D] -> out [N, H, D], lse [N, H]
    scores = torch.einsum("nhd,shd->nhs", q, k) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("nhs,shd->nhd", torch.softmax(scores, dim=-1), v), lse


def test_reference_merges_exactly(device: torch.device):
    """Attention over keys A ∪ B equals the merge of attention over A and over B."""
    gen = generator(2)
    q = randn(5, 4, 32, gen=gen, dtype=torch.float64, device=device)
    k = randn(30, 4, 32, gen=gen, dtype=torch.float64, device=device)
    v = randn(30, 4, 32, gen=gen, dtype=torch.float64, device=device)
    full, full_lse = _attend(q, k, v)
    out, lse = merge_attention_states_ref(*_attend(q, k[:11], v[:11]), *_attend(q, k[11:], v[11:]))
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse.float())


def test_cascade_from_kernels_equals_decode(dtype: torch.dtype, device: torch.device):
    """Cascade attention as the Triton backend runs it: a group of decode rows shares prefix
    blocks (non-causal prefill kernel over them, once), each row has private blocks (decode
    kernel), and merge_attention_states combines them. It must equal plain decode over each
    row's whole table."""
    gen = generator(3)
    block_size, kv_heads, group, head_dim = 8, 2, 4, 64
    shared_blocks, private_lens = 3, [5, 8, 17, 1]
    rows, heads = len(private_lens), kv_heads * group
    kv_cache, private = make_paged_kv(
        [shared_blocks * block_size] + private_lens, block_size=block_size,
        num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device=device, gen=gen,
        spare_columns=0,
    )  # fmt: skip
    shared_ids, private = private[0, :shared_blocks], private[1:, :3]
    full_tables = torch.cat([shared_ids.expand(rows, -1), private], dim=1)
    full_lens = torch.tensor(private_lens, device=device) + shared_blocks * block_size
    q = randn(rows, heads, head_dim, gen=gen, dtype=dtype, device=device)

    out_p, lse_p = paged_decode_attention(
        q, kv_cache, private, torch.tensor(private_lens, device=device), return_lse=True
    )
    meta = [torch.tensor([x], device=device) for x in (0, rows, shared_blocks * block_size)]
    out_s, lse_s = paged_prefill_attention(
        q, kv_cache, shared_ids[None], *meta, rows, causal=False, return_lse=True
    )
    out, lse = merge_attention_states(out_p, lse_p, out_s, lse_s)

    ref_out, ref_lse = paged_decode_attention_ref(
        q, kv_cache, full_tables, full_lens, return_lse=True
    )
    assert_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse)

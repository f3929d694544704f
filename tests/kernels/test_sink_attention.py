"""Attention sinks (gpt-oss) in the paged attention kernels, against their torch references
under the interpreter: decode rows in one split and several, prefill chunks after a cached
prefix with and without split keys, windows, and the cascade split (private part with the
sinks, shared part without, merged) equal to one decode with the sinks. The references are
checked against transformers' form: the sink as a last softmax column that takes no value."""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from kvbatch.kernels.merge_states import merge_attention_states
from kvbatch.kernels.prefill_attention import (
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

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 24  # head_dim not a power of two, as gpt-oss's tiny test


def sinks_for(device) -> torch.Tensor:
    return torch.tensor([2.0, -1.0, 0.5, 4.0, -3.0, 0.0, 1.5, 6.0], device=device)


def eager_sink_attention(q, k, v, sinks, window=None):
    """transformers' eager_attention_forward for gpt-oss, one causal sequence: q [Q, H, D] at
    the last Q positions of k, v [S, KVH, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * q.shape[-1] ** -0.5  # [H, Q, S]
    s, n = k.shape[1], q.shape[0]
    q_pos, k_pos = torch.arange(s - n, s)[:, None], torch.arange(s)[None, :]
    visible = k_pos <= q_pos if window is None else (k_pos <= q_pos) & (k_pos > q_pos - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    combined = torch.cat([scores, sinks[:, None, None].expand(-1, n, 1)], dim=-1)
    probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return (probs @ v).transpose(0, 1)


@pytest.mark.parametrize("window", [None, 5])
def test_references_are_transformers_sink_softmax(window):
    gen = generator(0)
    kv_cache, tables = make_paged_kv(
        [30], block_size=8, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
        device=torch.device("cpu"), gen=gen,
    )  # fmt: skip
    q = randn(6, HEADS, HEAD_DIM, gen=gen, dtype=torch.float32, device=torch.device("cpu"))
    sinks = sinks_for("cpu")
    k, v = gather_context(kv_cache, tables[0], 30)
    want = eager_sink_attention(q, k, v, sinks, window)
    meta = [torch.tensor(x) for x in ([0], [6], [30])]
    got = paged_prefill_attention_ref(
        q, kv_cache, tables, *meta, 6, sinks=sinks, sliding_window=window
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got_decode = paged_decode_attention_ref(
        q[-1:], kv_cache, tables, torch.tensor([30]), sinks=sinks, sliding_window=window
    )
    torch.testing.assert_close(got_decode, want[-1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [None, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("window", [None, 7], ids=["full", "window-7"])
def test_decode(num_splits, window, dtype, device):
    gen = generator(1)
    lens = [1, 40, 97, 16]
    kv_cache, tables = make_paged_kv(
        lens, block_size=8, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, device=device,
        gen=gen,
    )  # fmt: skip
    q = randn(len(lens), HEADS, HEAD_DIM, gen=gen, dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, device=device)
    kw = dict(return_lse=True, sinks=sinks_for(device), sliding_window=window)
    out, lse = paged_decode_attention(
        q, kv_cache, tables, seq_lens, out=poisoned(q), num_splits=num_splits, **kw
    )
    ref, ref_lse = paged_decode_attention_ref(q, kv_cache, tables, seq_lens, **kw)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse)
    plain = paged_decode_attention_ref(q, kv_cache, tables, seq_lens, sliding_window=window)
    assert (plain.float() - ref.float()).abs().max() > 0.05  # the sinks changed the output


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("window", [None, 9], ids=["full", "window-9"])
def test_causal_prefill(num_splits, window, dtype, device):
    gen = generator(2)
    chunks = [(9, 60), (17, 17), (1, 33)]  # (query_len, context_len)
    query_lens, context_lens = [q for q, _ in chunks], [c for _, c in chunks]
    starts = [sum(query_lens[:i]) for i in range(len(chunks))]
    kv_cache, tables = make_paged_kv(
        context_lens, block_size=8, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
        device=device, gen=gen,
    )  # fmt: skip
    q = randn(sum(query_lens), HEADS, HEAD_DIM, gen=gen, dtype=dtype, device=device)
    meta = [torch.tensor(x, device=device) for x in (starts, query_lens, context_lens)]
    kw = dict(return_lse=True, sinks=sinks_for(device), sliding_window=window)
    out, lse = paged_prefill_attention(
        q, kv_cache, tables, *meta, max(query_lens), out=poisoned(q), num_splits=num_splits, **kw
    )
    ref, ref_lse = paged_prefill_attention_ref(q, kv_cache, tables, *meta, max(query_lens), **kw)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse)


def test_cascade_counts_the_sink_once(device):
    """Private part with the sinks, shared part (non-causal) without, merged: one decode with
    the sinks over the whole context."""
    dtype, gen = torch.float32, generator(3)
    shared, private = 32, [3, 11]
    kv_cache, tables = make_paged_kv(
        [shared + n for n in private], block_size=8, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        dtype=dtype, device=device, gen=gen,
    )  # fmt: skip
    tables[1, : shared // 8] = tables[0, : shared // 8]  # both rows share the first 4 blocks
    q = randn(2, HEADS, HEAD_DIM, gen=gen, dtype=dtype, device=device)
    sinks = sinks_for(device)
    lens = torch.tensor([shared + n for n in private], device=device)
    want = paged_decode_attention_ref(q, kv_cache, tables, lens, sinks=sinks)
    private_tables = tables[:, shared // 8 :].contiguous()
    own, lse_p = paged_decode_attention(
        q, kv_cache, private_tables, torch.tensor(private, device=device), return_lse=True,
        sinks=sinks,
    )  # fmt: skip
    group = [torch.tensor(x, device=device) for x in ([0], [2], [shared])]
    common, lse_s = paged_prefill_attention(
        q, kv_cache, tables[:1, : shared // 8].contiguous(), *group, 2, causal=False,
        out=torch.empty_like(q), return_lse=True,
    )  # fmt: skip
    out, _ = merge_attention_states(own, lse_p, common, lse_s)
    assert_close(out, want, dtype)

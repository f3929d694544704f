"""The FP8 KV cache in the kernels: the write quantizes (value / scale, E4M3), decode and
prefill read E4M3 tiles and dequantize them in registers. Each against its torch reference,
and the references against attention over the unquantized cache.

Triton's interpreter runs these on the CPU (fp8 loads and stores work there; its own
float32 -> fp8 cast is replaced by kernels/fp8_cast.py's rounding).
"""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from kvbatch.kernels.kv_quant import quantize_kv
from kvbatch.kernels.kv_write import write_kv_cache, write_kv_cache_ref
from kvbatch.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from tests.kernels.conftest import assert_close, generator, make_paged_kv, randn

FP8 = torch.float8_e4m3fn
SCALES = [(1.0, 1.0), (0.05, 2.5)]  # the default, and checkpoint-like per-layer scales


def _fp8_cache(context_lens, *, k_scale, v_scale, gen, device, **shape):
    """A random float cache (values of the size K/V have once divided by their scales would
    be, so the E4M3 range is used), its FP8 image and the block tables."""
    cache, tables = make_paged_kv(
        context_lens, dtype=torch.float32, device=device, gen=gen, **shape
    )
    cache[0] *= k_scale * 20
    cache[1] *= v_scale * 20
    fp8 = torch.stack([quantize_kv(cache[0], k_scale, FP8), quantize_kv(cache[1], v_scale, FP8)])
    return cache, fp8, tables


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
@pytest.mark.parametrize("num_padding", [0, 2])
def test_write_quantizes_like_the_reference(k_scale, v_scale, num_padding, device):
    gen = generator(int(k_scale * 100) + num_padding)
    num_blocks, block_size, kv_heads, head_dim, tokens = 4, 8, 2, 32, 9
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device) * 30 * k_scale
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device) * 30 * v_scale
    k[0, 0, :4] = torch.tensor([1e6, -1e6, 0.0, 126.9 * k_scale])  # saturates; carries
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(device)
    slots[:num_padding] = -1
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, device=device).to(FP8)
    ref = cache.clone()

    write_kv_cache(cache, k, v, slots, k_scale=k_scale, v_scale=v_scale)
    write_kv_cache_ref(ref, k, v, slots, k_scale=k_scale, v_scale=v_scale)

    assert torch.equal(cache.float(), ref.float())
    flat = ref.float().view(2, -1, kv_heads, head_dim)
    row = slots[-1].long()  # the last token: never padding, no special values
    # stored = value / scale, to E4M3 precision (3 mantissa bits: 1/16 relative)
    torch.testing.assert_close(flat[0, row] * k_scale, k[-1], rtol=1 / 16, atol=2**-9 * k_scale)
    torch.testing.assert_close(flat[1, row] * v_scale, v[-1], rtol=1 / 16, atol=2**-9 * v_scale)
    if num_padding == 0:
        assert flat[0, slots[0].long(), 0, :4].tolist() == [448.0, -448.0, 0.0, 128.0]


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_reads_fp8(k_scale, v_scale, num_splits, dtype, device):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the interpreter mishandles bfloat16 dots")
    gen = generator(7)
    seq_lens = [0, 1, 17, 70]
    shape = dict(block_size=16, num_kv_heads=2, head_dim=32)
    cache, fp8, tables = _fp8_cache(seq_lens, k_scale=k_scale, v_scale=v_scale, gen=gen,
                                    device=device, **shape)  # fmt: skip
    q = randn(len(seq_lens), 8, 32, gen=gen, dtype=dtype, device=device) / k_scale / 20
    lens = torch.tensor(seq_lens, device=device)
    scales = dict(k_scale=k_scale, v_scale=v_scale)

    out, lse = paged_decode_attention(
        q, fp8, tables, lens, return_lse=True, num_splits=num_splits, **scales
    )
    ref, ref_lse = paged_decode_attention_ref(q, fp8, tables, lens, return_lse=True, **scales)

    assert_close(out / (20 * v_scale), ref / (20 * v_scale), dtype)  # outputs ~ 20 v_scale
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)
    # the reference dequantizes: it is close to attention over the unquantized cache
    exact = paged_decode_attention_ref(q.float(), cache, tables, lens).to(dtype)
    torch.testing.assert_close(
        ref[1:].float(), exact[1:].float(), atol=0.1 * v_scale * 20, rtol=0.1
    )


@pytest.mark.parametrize("k_scale, v_scale", SCALES)
@pytest.mark.parametrize("causal, num_splits", [(True, None), (True, 2), (False, None)])
def test_prefill_reads_fp8(k_scale, v_scale, causal, num_splits, dtype, device):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the interpreter mishandles bfloat16 dots")
    gen = generator(11)
    context_lens, query_lens = [20, 45], [5, 13]
    shape = dict(block_size=16, num_kv_heads=1, head_dim=32)
    _, fp8, tables = _fp8_cache(context_lens, k_scale=k_scale, v_scale=v_scale, gen=gen,
                                device=device, **shape)  # fmt: skip
    q = randn(sum(query_lens), 4, 32, gen=gen, dtype=dtype, device=device) / k_scale / 20
    ranges = [torch.tensor(x, device=device) for x in ([0, 5], query_lens, context_lens)]
    kw = dict(causal=causal, return_lse=True, k_scale=k_scale, v_scale=v_scale)

    out, lse = paged_prefill_attention(
        q, fp8, tables, *ranges, max(query_lens), num_splits=num_splits,
        max_context_len=max(context_lens), **kw,
    )  # fmt: skip
    ref, ref_lse = paged_prefill_attention_ref(q, fp8, tables, *ranges, max(query_lens), **kw)

    assert_close(out / (20 * v_scale), ref / (20 * v_scale), dtype)  # outputs ~ 20 v_scale
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=1e-4)


def test_scales_are_ignored_by_a_float_cache(device):
    """A float16 cache stores K/V as they are, whatever scales are passed."""
    cache = torch.zeros(2, 1, 4, 1, 16, dtype=torch.float16, device=device)
    k = torch.randn(2, 1, 16, device=device, dtype=torch.float16)
    write_kv_cache(cache, k, k, torch.tensor([0, 3], device=device), k_scale=0.5, v_scale=3.0)
    assert torch.equal(cache[0, 0, 0], k[0]) and torch.equal(cache[1, 0, 3], k[1])

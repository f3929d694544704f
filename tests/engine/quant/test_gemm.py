"""The per-scheme GEMMs' reference path: the weight dequantized once (CPU) or per call (CUDA
without a fused kernel) gives the same answer, and the quantization round trips behave at the
edges (all-zero tokens, huge and tiny magnitudes)."""

from __future__ import annotations

import torch

from kvbatch.engine.quant import gemm
from kvbatch.engine.quant.qdq import (
    FP8_MAX,
    fake_quantize_fp8,
    fake_quantize_int8_per_token,
    quantize_fp8_per_channel,
    quantize_int8_per_token,
)
from kvbatch.engine.quant.wna16_layout import WNA16Weights, pack_rows, unpack_rows


def test_dequantizing_per_call_gives_the_cached_weights_answer():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    w = torch.randn(48, 64, generator=g)
    w8, scale = quantize_fp8_per_channel(w)
    cached = gemm.fp8_linear(x, w8, scale, None, None, (w8.float() * scale))
    torch.testing.assert_close(gemm.fp8_linear(x, w8, scale, None, None, None), cached)
    q, s = quantize_int8_per_token(w)  # per row of w: a per-channel int8 weight
    cached = gemm.int8_linear(x, q, s, None, q.float() * s)
    torch.testing.assert_close(gemm.int8_linear(x, q, s, None, None), cached)
    packed = WNA16Weights(
        pack_rows(torch.randint(0, 16, (64, 48), generator=g), 4),
        torch.rand(2, 48, generator=g),
        torch.full((2, 48), 8.0),
        None,
        32,
        4,
    )
    cached = gemm.wna16_linear(x, packed, None, packed.dequantize())
    torch.testing.assert_close(gemm.wna16_linear(x, packed, None, None), cached)


def test_round_trips_at_the_edges():
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1e-30, -2e-30, 0.0, 3e-30], [1e4, -3e4, 5.0, 0.0]])
    step = x.abs().amax(-1, keepdim=True) / 127.5  # int8: one step of each token's scale
    fp8, int8 = fake_quantize_fp8(x, None), fake_quantize_int8_per_token(x)
    for y in (fp8, int8):
        assert torch.isfinite(y).all()
        assert torch.equal(y[0], x[0])  # an all-zero token stays zero
    assert ((int8 - x).abs() <= step).all()
    assert ((fp8 - x).abs() <= x.abs() / 16 + 1e-9).all()  # E4M3: 3 mantissa bits
    # FP8 keeps each token's largest magnitude exactly (it maps to 448)
    assert fake_quantize_fp8(x, None)[2].abs().max() == 3e4
    # a static scale saturates instead of overflowing: E4M3 has no infinity
    assert fake_quantize_fp8(x, torch.tensor([[1.0]]))[2].abs().max() == FP8_MAX


def test_packing_round_trips_every_value():
    for bits in (4, 8):
        q = torch.arange(1 << bits).repeat(32 // bits * 4, 3)[: 32 // bits * 8]  # [K, N]
        torch.testing.assert_close(unpack_rows(pack_rows(q, bits), bits), q.to(torch.int32))

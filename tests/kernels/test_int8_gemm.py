"""kernels/int8_gemm.py: INT8 per-token quantization and the scaled INT8 GEMM against their
references (the interpreter runs int8 dots with int32 accumulation on the CPU)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.int8_gemm import (
    int8_scaled_mm,
    int8_scaled_mm_reference,
    quantize_int8_per_token,
    quantize_int8_per_token_reference,
)
from tests.kernels.conftest import generator


@pytest.mark.parametrize("M, K", [(1, 16), (5, 100), (33, 1030), (3, 7)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_quantize_per_token_matches_reference(M, K, x_dtype, device, rows_per_program):
    gen = generator(M * 17 + K)
    x = (torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 30).to(x_dtype)
    x = x.to(device)
    q, scale = quantize_int8_per_token(x)
    q_ref, scale_ref = quantize_int8_per_token_reference(x)
    assert q.dtype == torch.int8 and scale.shape == (M, 1)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert (q.int() - q_ref.int()).abs().max() <= (0 if device.type == "cpu" else 1)
    peak = q.int().abs().amax(dim=1)  # absmax maps to 127.5: 127, or -128 on the negative side
    assert ((peak == 127) | (peak == 128)).all()
    # the clamped top (127.5 -> 127) is off by half a step exactly: allow float32 rounding
    assert ((q.float() * scale - x.float()).abs() <= scale * 0.5001 + 1e-6).all()


def test_rounding_is_half_to_even_as_compressed_tensors(device):
    # absmax 127.5 makes the scale 1: values are rounded as they are, clamped to [-128, 127]
    x = torch.tensor([[127.5, 0.5, -0.5, 1.5, -2.5, 0.49, 0.0, -127.5]], device=device)
    q, scale = quantize_int8_per_token(x)
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 0, 2, -2, 0, 0, -128]]
    assert torch.equal(q, quantize_int8_per_token_reference(x)[0])


def test_zero_row(device):
    q, scale = quantize_int8_per_token(torch.zeros(2, 9, device=device))
    assert torch.equal(q, torch.zeros_like(q)) and (scale > 0).all()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M, K, N", [(1, 32, 16), (7, 96, 40), (20, 300, 64), (3, 19, 5)])
def test_scaled_mm_matches_reference(M, K, N, out_dtype, device):
    gen = generator(M * 7 + K + N)
    a = torch.randint(-127, 128, (M, K), generator=gen, dtype=torch.int8).to(device)
    b = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8).to(device)
    a_scale = torch.rand(M, 1, generator=gen).to(device) * 0.01
    b_scale = torch.rand(N, 1, generator=gen).to(device) * 0.01
    bias = torch.randn(N, generator=gen).to(device=device, dtype=out_dtype)

    out = int8_scaled_mm(a, a_scale, b, b_scale, out_dtype, bias)
    ref = int8_scaled_mm_reference(a, a_scale, b, b_scale, out_dtype, bias)

    tol = {torch.float32: 1e-6, torch.float16: 1e-3}[out_dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    exact = (a.long() @ b.long().T).double() * a_scale.double() * b_scale.double().T
    torch.testing.assert_close(ref.double(), exact + bias.double(), rtol=tol, atol=tol)


def test_extreme_values_accumulate_exactly(device):
    """-127 * -127 over a long K: the int32 accumulator holds it (no int8/fp16 overflow)."""
    K = 4096
    a = torch.full((2, K), -127, dtype=torch.int8, device=device)
    b = torch.full((3, K), -127, dtype=torch.int8, device=device)
    one = torch.ones(1, 1, device=device)
    out = int8_scaled_mm(a, one, b, one, torch.float32)
    assert torch.equal(out, torch.full((2, 3), 127.0 * 127.0 * K, device=device))


def test_quantize_then_gemm_approximates_the_float_gemm(device):
    gen = generator(9)
    x = torch.randn(6, 64, generator=gen).to(device)
    w = torch.randn(24, 64, generator=gen).to(device) * 0.05
    w_scale = w.abs().amax(dim=1, keepdim=True) / 127
    w_q = torch.round(w / w_scale).to(torch.int8)
    x_q, x_scale = quantize_int8_per_token(x)
    out = int8_scaled_mm(x_q, x_scale, w_q, w_scale, torch.float32)
    exact = x @ w.T
    assert (out - exact).norm() / exact.norm() < 0.02


def test_wrong_dtype_is_named(device):
    with pytest.raises(ValueError, match="int8"):
        int8_scaled_mm(
            torch.zeros(2, 16, device=device), torch.ones(2, 1, device=device),
            torch.zeros(4, 16, device=device), torch.ones(4, 1, device=device), torch.float32,
        )  # fmt: skip

"""kernels/fp8_gemm.py: FP8 per-token quantization and the scaled FP8 GEMM against their
references, and the references against the definition (dequantize, then a float matmul).

Triton's interpreter (3.9) loads, stores and multiplies float8_e4m3fn tensors on the CPU, so
the kernels themselves run here; on a GPU with FP8 tensor cores torch._scaled_mm serves the
shapes it supports and those are checked against the same reference.
"""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.fp8_gemm import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    fp8_scaled_mm,
    fp8_scaled_mm_reference,
    quantize_fp8_per_token,
    quantize_fp8_per_token_reference,
    quantize_fp8_static,
    quantize_fp8_static_reference,
)
from tests.kernels.conftest import generator

OUT_DTYPES = [torch.float32, torch.float16] + (
    [torch.bfloat16] if torch.cuda.is_available() else []
)


def _fp8_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal fp8 values, or one E4M3 step apart (a GPU's division may round the last bit of
    x / scale differently)."""
    a, e = actual.float(), expected.float()
    step = torch.where(e.abs() >= 2**-6, e.abs() * 2**-3, torch.full_like(e, 2**-9))
    assert ((a - e).abs() <= step).all(), (a - e).abs().max()
    if actual.device.type == "cpu":
        assert torch.equal(a, e)  # the same value (a zero's sign may differ)


def _random_fp8(rows, cols, gen, device, spread=4.0):
    return (torch.randn(rows, cols, generator=gen) * spread).to(FP8_DTYPE).to(device)


@pytest.mark.parametrize("M, K", [(1, 16), (5, 100), (33, 1030), (3, 7)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_quantize_per_token_matches_reference(M, K, x_dtype, device, rows_per_program):
    gen = generator(M * 13 + K)
    x = (torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 50).to(x_dtype)
    x = x.to(device)
    q, scale = quantize_fp8_per_token(x)
    q_ref, scale_ref = quantize_fp8_per_token_reference(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (M, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    _fp8_equal(q, q_ref)
    # The row's largest value maps to +-448, and dequantizing stays within E4M3's precision.
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((M,), FP8_MAX, device=device))
    torch.testing.assert_close(q.float() * scale, x.float(), rtol=2**-4, atol=scale.max().item())


def test_quantize_zero_and_tiny_rows(device):
    """An all-zero row gets the floor scale and zeros; a tiny row is not flushed to zero."""
    x = torch.zeros(3, 32, device=device)
    x[1, 5] = 1e-4  # below 448 * MIN_SCALE: the floor scale, still representable
    x[2] = torch.linspace(-1e4, 1e4, 32)
    q, scale = quantize_fp8_per_token(x)
    assert scale[0].item() == pytest.approx(MIN_SCALE) and torch.equal(q[0].float(), x[0])
    assert q[1, 5].float().item() > 0
    assert torch.isfinite(q.float()).all()
    _fp8_equal(q, quantize_fp8_per_token_reference(x)[0])


def test_quantize_static_clamps_to_range(device):
    """A static scale too small for the values saturates at +-448 instead of producing NaN."""
    x = torch.tensor([[1.0, -2.0, 1000.0, -1000.0]], device=device)
    scale = torch.tensor([[0.5]], device=device)
    q = quantize_fp8_static(x, scale)
    assert q.float().tolist() == [[2.0, -4.0, FP8_MAX, -FP8_MAX]]
    _fp8_equal(q, quantize_fp8_static_reference(x, scale))


def test_rounding_carries_into_the_exponent_and_ties_go_to_even(device):
    """Values that round up to the next power of two, ties, and subnormals: the kernel's fp8
    values equal torch's cast (the interpreter's own cast gets the first two wrong,
    kernels/fp8_cast.py)."""
    values = [126.9, 127.99, 7.75, 15.5, 9.5, 0.0146, 2**-7 + 2**-10, 2**-9 * 0.5, 447.0, 0.0]
    x = torch.tensor([values + [-v for v in values]], device=device)
    q = quantize_fp8_static(x, torch.ones(1, 1, device=device))
    expected = x.to(FP8_DTYPE)
    assert torch.equal(q.float(), expected.float()), (q.float(), expected.float())  # -0 == 0
    assert q.float()[0, :4].tolist() == [128.0, 128.0, 8.0, 16.0]


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("per_token, per_channel", [(True, True), (False, False), (False, True)])
@pytest.mark.parametrize("M, K, N", [(1, 32, 16), (7, 96, 40), (20, 80, 64), (3, 19, 5)])
def test_scaled_mm_matches_reference(M, K, N, per_token, per_channel, out_dtype, device):
    if out_dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the interpreter mishandles bfloat16")
    gen = generator(M * 101 + K * 3 + N)
    a, b = _random_fp8(M, K, gen, device), _random_fp8(N, K, gen, device)
    a_scale = torch.rand(M if per_token else 1, 1, generator=gen).to(device) + 0.01
    b_scale = torch.rand(N if per_channel else 1, 1, generator=gen).to(device) * 0.01
    bias = torch.randn(N, generator=gen).to(device=device, dtype=out_dtype)

    out = fp8_scaled_mm(a, a_scale, b, b_scale, out_dtype, bias)
    ref = fp8_scaled_mm_reference(a, a_scale, b, b_scale, out_dtype, bias)

    assert out.dtype == out_dtype and out.shape == (M, N)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[out_dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    # The reference is the definition: dequantize both, then a float matmul.
    expected = (a.float() * a_scale) @ (b.float() * b_scale).T + bias.float()
    torch.testing.assert_close(ref.float(), expected, rtol=tol, atol=tol)


def test_quantize_then_gemm_approximates_the_float_gemm(device):
    """The W8A8 pipeline end to end: per-token x, per-channel w, close to x @ w.T."""
    gen = generator(7)
    x = torch.randn(6, 64, generator=gen).to(device)
    w = torch.randn(24, 64, generator=gen).to(device) * 0.05
    w_scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    w_fp8 = (w / w_scale).to(FP8_DTYPE)
    x_fp8, x_scale = quantize_fp8_per_token(x)
    out = fp8_scaled_mm(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
    exact = x @ w.T
    assert (out - exact).norm() / exact.norm() < 0.05


def test_zero_scale_gives_zeros(device):
    a, b = _random_fp8(4, 32, generator(3), device), _random_fp8(8, 32, generator(4), device)
    b_scale = torch.ones(8, 1, device=device)
    b_scale[2] = 0.0
    out = fp8_scaled_mm(a, torch.ones(4, 1, device=device), b, b_scale, torch.float32)
    assert torch.equal(out[:, 2], torch.zeros(4, device=device))


@pytest.mark.parametrize(
    "a_shape, a_scale_shape, b_scale_shape, match",
    [
        ((4, 32), (3, 1), (8, 1), r"a_scale must be float32 \[4, 1\]"),
        ((4, 32), (4, 1), (8,), r"b_scale must be float32 \[8, 1\]"),
        ((4, 16), (4, 1), (8, 1), "must share K"),
    ],
)
def test_bad_shapes_name_the_fix(a_shape, a_scale_shape, b_scale_shape, match, device):
    a = torch.zeros(a_shape, device=device).to(FP8_DTYPE)
    b = torch.zeros(8, 32, device=device).to(FP8_DTYPE)
    with pytest.raises(ValueError, match=match):
        fp8_scaled_mm(
            a, torch.ones(a_scale_shape, device=device), b, torch.ones(b_scale_shape, device=device),
            torch.float32,
        )  # fmt: skip


def test_plain_float_inputs_are_refused(device):
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_scaled_mm(
            torch.zeros(2, 16, device=device), torch.ones(1, 1, device=device),
            torch.zeros(4, 16, device=device), torch.ones(1, 1, device=device), torch.float32,
        )  # fmt: skip

"""kernels/fp8_block_gemm.py: per-token-group FP8 quantization and the block-scaled FP8 GEMM
against their plain-torch references, and the references against the definition (each K
block's dot of the dequantized operands)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.fp8_block_gemm import (
    fp8_block_scaled_mm,
    fp8_block_scaled_mm_reference,
    kernel_block_k,
    quantize_fp8_per_token_group,
    quantize_fp8_per_token_group_reference,
)
from kvbatch.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX
from tests.kernels.conftest import generator

# (M, N, K, [block_n, block_k]): DeepSeek's 128 blocks, small ones, partial blocks along N and K
CASES = [
    (1, 64, 128, (128, 128)),
    (17, 200, 256, (128, 128)),
    (5, 70, 100, (32, 32)),
    (33, 40, 96, (16, 96)),
    (3, 48, 64, (48, 64)),
]


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = generator(seed)
    return torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 30


@pytest.mark.parametrize("M, N, K, block", CASES)
def test_group_quantization_matches_reference(M, N, K, block, device, rows_per_program):
    x = _activations(M, K, seed=M + K).to(device)
    x[0, : block[1]] = 0.0  # an all-zero group gets a finite scale and zeros
    q, scale = quantize_fp8_per_token_group(x, block[1])
    q_ref, scale_ref = quantize_fp8_per_token_group_reference(x, block[1])
    groups = -(-K // block[1])
    assert q.dtype == FP8_DTYPE and scale.shape == (M, groups) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(q.float().cpu(), q_ref.float().cpu())
    assert torch.equal(q[0, : block[1]].float().cpu(), torch.zeros(block[1]))
    # every non-zero group's largest value maps to +-448
    peak = q.float().abs().cpu()
    for j in range(groups):
        cols = slice(j * block[1], (j + 1) * block[1])
        nonzero = x[:, cols].abs().amax(1).cpu() > 0
        assert torch.equal(
            peak[:, cols].amax(1)[nonzero], torch.full((int(nonzero.sum()),), FP8_MAX)
        )


@pytest.mark.parametrize("M, N, K, block", CASES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_block_scaled_mm_matches_reference(M, N, K, block, out_dtype, device):
    g = generator(M * 7 + N)
    a, a_scale = quantize_fp8_per_token_group(_activations(M, K, seed=N).to(device), block[1])
    b = (torch.randn(N, K, generator=g) * 50).clamp(-448, 448).to(FP8_DTYPE).to(device)
    b_scale = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) * 1e-3 + 1e-4
    bias = torch.randn(N, generator=g).to(device)
    b_scale = b_scale.to(device)
    out = fp8_block_scaled_mm(a, a_scale, b, b_scale, block, out_dtype, bias)
    ref = fp8_block_scaled_mm_reference(a, a_scale, b, b_scale, block, out_dtype, bias)
    assert out.shape == (M, N) and out.dtype == out_dtype
    tol = 1e-4 if out_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_reference_is_the_dequantized_product():
    """Each operand times its expanded scales, then one float64 matmul: the same sums."""
    M, N, K, (bn, bk) = 6, 50, 80, (32, 32)
    g = generator(11)
    a, a_scale = quantize_fp8_per_token_group_reference(_activations(M, K, seed=2), bk)
    b = (torch.randn(N, K, generator=g) * 50).to(FP8_DTYPE)
    b_scale = torch.rand(2, 3, generator=g) + 0.5
    a_full = a.double() * a_scale.double().repeat_interleave(bk, 1)[:, :K]
    b_full = (
        b.double() * b_scale.double().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    )
    ref = fp8_block_scaled_mm_reference(a, a_scale, b, b_scale, (bn, bk), torch.float32)
    torch.testing.assert_close(ref, (a_full @ b_full.T).float(), atol=1e-3, rtol=1e-5)


def test_wrong_scales_and_blocks_are_refused():
    a = torch.zeros(4, 64, dtype=FP8_DTYPE)
    b = torch.zeros(32, 64, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match=r"b_scale must be float32 \[1, 2\]"):
        fp8_block_scaled_mm(a, torch.ones(4, 2), b, torch.ones(2, 2), (32, 32), torch.float32)
    with pytest.raises(ValueError, match=r"a_scale must be float32 \[4, 2\]"):
        fp8_block_scaled_mm(a, torch.ones(4, 1), b, torch.ones(1, 2), (32, 32), torch.float32)
    with pytest.raises(ValueError, match="multiple of 32 columns"):
        kernel_block_k(48)
    assert [kernel_block_k(v) for v in (32, 96, 128, 256)] == [32, 32, 128, 128]

"""kernels/rms_norm_quant.py: RMSNorm (+ residual) fused with FP8 per-token quantization,
against the composition of the two references."""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.rms_norm_quant import rms_norm_quant_fp8, rms_norm_quant_fp8_reference
from tests.kernels.conftest import generator


def _same_fp8(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal on the CPU; on a GPU one E4M3 step apart at most (division rounding)."""
    a, e = actual.float(), expected.float()
    if actual.device.type == "cpu":
        assert torch.equal(a, e)
    else:
        assert ((a - e).abs() <= e.abs() / 8 + 2**-9).all()


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 576), (33, 100)])
def test_matches_the_two_references(rows, hidden, x_dtype, with_residual, device, rows_per_program):
    gen = generator(rows * 7 + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(device=device, dtype=x_dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(device=device, dtype=x_dtype)
    residual = (torch.randn(rows, hidden, generator=gen) * 2).to(device=device, dtype=x_dtype)
    ref_residual = residual.clone()

    q, scale = rms_norm_quant_fp8(x, weight, 1e-5, residual if with_residual else None)
    q_ref, scale_ref = rms_norm_quant_fp8_reference(
        x, weight, 1e-5, ref_residual if with_residual else None
    )

    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    _same_fp8(q, q_ref)
    assert torch.equal(residual, ref_residual)  # updated in place exactly as the reference
    if with_residual:
        assert not torch.equal(residual, x)


def test_too_wide_a_row_names_the_unfused_path(device):
    x = torch.zeros(1, 8200, device=device)
    with pytest.raises(ValueError, match="use rms_norm, then quantize_fp8_per_token"):
        rms_norm_quant_fp8(x, torch.ones(8200, device=device), 1e-5)

"""kernels/rms_norm.py: RMSNorm and fused add + RMSNorm against their references and the engine's
RMSNorm layer (engine/layers/norm.py). On the CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.layers.norm import RMSNorm
from kvbatch.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
SHAPES = [(1, 64), (7, 576), (5, 2048), (3, 8192)]
EPS = 1e-6


def _close(actual, expected, dtype) -> None:
    torch.testing.assert_close(actual, expected, rtol=TOL[dtype], atol=TOL[dtype])


def _inputs(num_tokens: int, hidden: int, dtype):
    torch.manual_seed(num_tokens * 7 + hidden)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=_device()) * 3
    weight = torch.randn(hidden, dtype=dtype, device=_device())
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", SHAPES)
def test_rms_norm_matches_reference(dtype, num_tokens, hidden, rows_per_program):
    x, weight = _inputs(num_tokens, hidden, dtype)
    x_before = x.clone()
    out = torch.full_like(x, float("nan"))

    result = rms_norm(x, weight, EPS, out=out)

    assert result is out
    _close(out, rms_norm_ref(x, weight, EPS), dtype)
    assert torch.equal(x, x_before)
    _close(rms_norm(x, weight, EPS), out, dtype)  # without out=


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_and_strided_rows(dtype):
    """out may be x itself; x may be a column slice of a wider tensor (row stride != hidden)."""
    torch.manual_seed(3)
    wide = torch.randn(5, 640, dtype=dtype, device=_device())
    x = wide[:, 32:608]  # [5, 576], row stride 640
    weight = torch.randn(576, dtype=dtype, device=_device())
    expected = rms_norm_ref(x, weight, EPS)
    untouched = wide.clone()

    rms_norm(x, weight, EPS, out=x)

    _close(x, expected, dtype)
    assert torch.equal(wide[:, :32], untouched[:, :32])
    assert torch.equal(wide[:, 608:], untouched[:, 608:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", SHAPES)
def test_fused_add_rms_norm_matches_reference(dtype, num_tokens, hidden, rows_per_program):
    x, weight = _inputs(num_tokens, hidden, dtype)
    residual = torch.randn_like(x)
    ref_residual = residual.clone()

    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, _ = fused_add_rms_norm_ref(x, ref_residual, weight, 1e-5)

    assert new_residual is residual  # updated in place
    torch.testing.assert_close(residual, ref_residual, rtol=0, atol=0)  # one rounding, same
    assert not out.isnan().any()
    _close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_references_match_engine_rmsnorm(dtype):
    """The references are the engine's module to the bit, so they can vouch for the kernel."""
    x, weight = _inputs(7, 576, dtype)
    module = RMSNorm(576, EPS).to(device=_device(), dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        assert torch.equal(rms_norm_ref(x, weight, EPS), module(x))
        residual = torch.randn_like(x)
        out, new_residual = fused_add_rms_norm_ref(x, residual.clone(), weight, EPS)
        assert torch.equal(new_residual, residual + x)
        assert torch.equal(out, module(residual + x))
        layer_out, layer_residual = module(x, residual.clone())  # the fused add, torch path
        assert torch.equal(layer_out, out) and torch.equal(layer_residual, new_residual)


def test_bad_shapes_are_named():
    x = torch.zeros(2, 64, device=_device())
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, device=_device()), EPS)
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, torch.ones(64, device=_device()), EPS, out=torch.empty(2, 32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 576), (3, 2304)])
def test_unit_offset_matches_reference(dtype, num_tokens, hidden, rows_per_program):
    """Gemma's (1 + w) norm, alone and after the residual add; w around zero, as Gemma stores it."""
    x, weight = _inputs(num_tokens, hidden, dtype)
    weight = weight * 0.1
    residual = torch.randn_like(x)
    ref_residual = residual.clone()

    alone = rms_norm(x, weight, EPS, unit_offset=True)
    out, _ = fused_add_rms_norm(x, residual, weight, EPS, unit_offset=True)
    ref_out, _ = fused_add_rms_norm_ref(x, ref_residual, weight, EPS, unit_offset=True)

    _close(alone, rms_norm_ref(x, weight, EPS, unit_offset=True), dtype)
    torch.testing.assert_close(residual, ref_residual, rtol=0, atol=0)
    _close(out, ref_out, dtype)
    # the offset is really applied: (1 + w) is not w
    assert (alone.float() - rms_norm_ref(x, weight, EPS).float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset_in_place(dtype):
    """out may be x (the fused Gemma forward norms each sublayer's output where it lies)."""
    x, weight = _inputs(5, 576, dtype)
    expected = rms_norm_ref(x, weight, EPS, unit_offset=True)

    rms_norm(x, weight, EPS, out=x, unit_offset=True)

    _close(x, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unit_offset_reference_matches_gemma_rmsnorm(dtype):
    """The unit-offset reference is the engine's Gemma module to the bit, with a float32
    weight (as loaded beside float16 activations or not) and one in x's dtype."""
    x, weight = _inputs(7, 576, dtype)
    module = RMSNorm(576, EPS, unit_offset=True).to(device=_device())
    for w in (weight.float(), weight):
        with torch.no_grad():
            module.to(w.dtype).weight.copy_(w)
            assert torch.equal(rms_norm_ref(x, w, EPS, unit_offset=True), module(x))

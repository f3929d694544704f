"""kernels/activation.py: SiLU- and GELU(tanh)-and-mul against their references and the MLPs.

On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbatch.engine.layers.activation import GeluTanhAndMul, SiluAndMul
from kvbatch.kernels.activation import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def _close(actual, expected, dtype) -> None:
    torch.testing.assert_close(actual, expected, rtol=TOL[dtype], atol=TOL[dtype])


def _inputs(num_tokens: int, ffn: int, dtype):
    torch.manual_seed(num_tokens * 11 + ffn)
    gate = torch.randn(num_tokens, ffn, dtype=dtype, device=_device()) * 4
    up = torch.randn(num_tokens, ffn, dtype=dtype, device=_device())
    return gate, up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, ffn", [(1, 64), (7, 576), (5, 2048), (3, 3000)])
def test_matches_reference(dtype, num_tokens, ffn, rows_per_program):
    gate, up = _inputs(num_tokens, ffn, dtype)
    gate_before, up_before = gate.clone(), up.clone()
    out = torch.full_like(gate, float("nan"))

    result = silu_and_mul(gate, up, out=out)

    assert result is out
    _close(out, silu_and_mul_ref(gate, up), dtype)
    assert torch.equal(gate, gate_before) and torch.equal(up, up_before)
    _close(silu_and_mul(gate, up), out, dtype)  # without out=


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_on_gate_of_fused_gate_up(dtype):
    """gate and up as the two halves of one [T, 2F] projection; the result written over gate."""
    torch.manual_seed(6)
    gate_up = torch.randn(5, 2 * 1100, dtype=dtype, device=_device()) * 4
    gate, up = gate_up[:, :1100], gate_up[:, 1100:]
    expected = silu_and_mul_ref(gate, up)
    up_before = up.clone()

    result = silu_and_mul(gate, up, out=gate)

    assert result is gate
    _close(gate, expected, dtype)
    assert torch.equal(up, up_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_matches_engine_mlp(dtype):
    """The SwiGLU layer's torch path (engine/layers/activation.py) is the reference, to the bit."""
    gate, up = _inputs(7, 576, dtype)
    expected = SiluAndMul()(torch.cat([gate, up], dim=-1))
    assert torch.equal(expected, F.silu(gate.clone(), inplace=True).mul_(up))
    assert torch.equal(silu_and_mul_ref(gate, up), expected)
    out = torch.empty_like(gate)
    assert torch.equal(silu_and_mul_ref(gate, up, out=out), expected)


def test_mismatched_shapes_are_named():
    gate = torch.zeros(2, 64, device=_device())
    with pytest.raises(ValueError, match="gate and up"):
        silu_and_mul(gate, torch.zeros(2, 32, device=_device()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, ffn", [(1, 64), (7, 576), (3, 3000)])
def test_gelu_tanh_matches_reference(dtype, num_tokens, ffn, rows_per_program):
    """GeGLU's gate, over the whole range of the tanh: large |gate| saturates it without
    overflow, near zero it is nearly linear."""
    gate, up = _inputs(num_tokens, ffn, dtype)
    gate[:, :8] = torch.tensor([-60.0, -9.0, -1e-3, 0.0, 1e-3, 0.7, 9.0, 60.0], dtype=dtype)
    out = torch.full_like(gate, float("nan"))

    result = gelu_tanh_and_mul(gate, up, out=out)

    assert result is out
    _close(out, gelu_tanh_and_mul_ref(gate, up), dtype)
    # not SiLU's gate
    assert (out.float() - silu_and_mul_ref(gate, up).float()).abs().max() > 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_in_place_on_gate_of_fused_gate_up(dtype):
    torch.manual_seed(8)
    gate_up = torch.randn(5, 2 * 1100, dtype=dtype, device=_device()) * 4
    gate, up = gate_up[:, :1100], gate_up[:, 1100:]
    expected = gelu_tanh_and_mul_ref(gate, up)

    gelu_tanh_and_mul(gate, up, out=gate)

    _close(gate, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_tanh_reference_matches_gemma_mlp(dtype):
    """The GeGLU layer's torch path (engine/layers/activation.py) is the reference, to the bit."""
    gate, up = _inputs(7, 576, dtype)
    expected = GeluTanhAndMul()(torch.cat([gate, up], dim=-1))
    assert torch.equal(expected, F.gelu(gate, approximate="tanh") * up)
    assert torch.equal(gelu_tanh_and_mul_ref(gate, up), expected)
    out = torch.empty_like(gate)
    assert torch.equal(gelu_tanh_and_mul_ref(gate, up, out=out), expected)

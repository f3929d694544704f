"""gemm.py's "triton" path (kvbatch.kernels' GEMMs; TRITON_INTERPRET=1 on the CPU, compiled on
CUDA) against its "torch" path (the dequantized float weight) on the same quantized layers:
every scheme, static and dynamic activation scales, act-order groups, a bias, 3-D inputs, and
the W4A16 rule's two sides of WNA16_KERNEL_MAX_BATCH; block-scaled FP8 with partial blocks."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.quant import gemm
from kvbatch.engine.quant.linear import (
    Fp8BlockLinear,
    Fp8Linear,
    Int8Linear,
    QuantLinear,
    WNA16Linear,
    use_gemm_backend,
)
from kvbatch.engine.quant.qdq import FP8_DTYPE, absmax_scale, quantize_fp8_per_channel
from kvbatch.engine.quant.wna16_layout import WNA16Weights, pack_rows

K, N = 96, 40  # not multiples of the kernels' tiles
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter divides as torch does; compiled, an activation can land one quantization
# step away (int8 rounding after a faster division), which moves an output by a few 1e-3.
ATOL, RTOL = (2e-4, 1e-4) if DEVICE.type == "cpu" else (2e-2, 1e-2)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8_layer(static: bool, bias: bool) -> Fp8Linear:
    g = _gen(1)
    w8, scale = quantize_fp8_per_channel(torch.randn(N, K, generator=g))
    input_scale = torch.tensor([[0.02]]) if static else None
    return Fp8Linear(w8, scale, input_scale, torch.randn(N, generator=g) if bias else None)


def _fp8_block_layer(block: tuple[int, int], bias: bool) -> Fp8BlockLinear:
    """Random E4M3 values and block scales: the layer need not come from a float weight."""
    g = _gen(4)
    weight = (torch.randn(N, K, generator=g) * 40).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) * 0.01 + 1e-3
    return Fp8BlockLinear(weight, scale, block, torch.randn(N, generator=g) if bias else None)


def _int8_layer(bias: bool) -> Int8Linear:
    g = _gen(2)
    w = torch.randn(N, K, generator=g)
    scale = absmax_scale(w, 127.0, dim=1)
    q = (w / scale).round().clamp(-127, 127).to(torch.int8)
    return Int8Linear(q, scale, torch.randn(N, generator=g) if bias else None)


def _wna16_layer(bits: int, act_order: bool, bias: bool) -> WNA16Linear:
    g, group = _gen(3), 32
    q = torch.randint(0, 1 << bits, (K, N), generator=g)
    groups = K // group
    g_idx = torch.randperm(K, generator=g).to(torch.int32) // group if act_order else None
    weights = WNA16Weights(
        pack_rows(q, bits),
        torch.rand(groups, N, generator=g) * 0.05 + 0.001,
        torch.randint(0, 1 << bits, (groups, N), generator=g).float(),
        g_idx,
        group,
        bits,
    )
    return WNA16Linear(weights, torch.randn(N, generator=g) if bias else None)


LAYERS = {
    "fp8-dynamic": lambda: _fp8_layer(static=False, bias=False),
    "fp8-static-bias": lambda: _fp8_layer(static=True, bias=True),
    "fp8-block": lambda: _fp8_block_layer((32, 32), bias=False),  # N = 40: a partial block
    "fp8-block-bias": lambda: _fp8_block_layer((16, 96), bias=True),
    "fp8-block-partial-k": lambda: _fp8_block_layer((16, 64), bias=False),  # K = 96 = 64 + 32
    "int8": lambda: _int8_layer(bias=False),
    "int8-bias": lambda: _int8_layer(bias=True),
    "w4a16": lambda: _wna16_layer(4, act_order=False, bias=False),
    "w4a16-act-order-bias": lambda: _wna16_layer(4, act_order=True, bias=True),
    "w8a16-act-order": lambda: _wna16_layer(8, act_order=True, bias=False),
}


def _both_backends(layer: QuantLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    layer.to(DEVICE)
    x = x.to(DEVICE)
    layer.prepare(torch.float32)  # the CPU's float weight (none on CUDA), for the torch path
    reference = layer(x)
    layer.use_backend("triton")
    return layer(x), reference


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("rows", [1, 7])
def test_kernels_give_the_dequantized_layers_answer(name, rows):
    layer = LAYERS[name]()
    x = torch.randn(rows, K, generator=_gen(rows)) * 3
    out, reference = _both_backends(layer, x)
    assert out.shape == (rows, N) and out.dtype == x.dtype
    # both quantize x the same way; the sums differ in order only
    torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)


def test_kernels_take_a_batch_of_sequences_and_an_all_zero_token():
    layer = LAYERS["fp8-dynamic"]()
    x = torch.randn(2, 3, K, generator=_gen(5))
    x[1, 2] = 0.0
    out, reference = _both_backends(layer, x)
    assert out.shape == (2, 3, N)
    torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)
    assert torch.equal(out[1, 2].cpu(), torch.zeros(N))  # no bias: a zero token gives zeros


def test_wna16_rule_switches_to_dequantize_then_gemm_above_the_crossover(monkeypatch):
    calls = []
    real_kernel = gemm.wna16_gemm
    monkeypatch.setattr(gemm, "wna16_gemm", lambda *a: calls.append(a[0].shape) or real_kernel(*a))
    layer = LAYERS["w4a16-act-order-bias"]()
    small = torch.randn(gemm.WNA16_KERNEL_MAX_BATCH, K, generator=_gen(6))
    large = torch.randn(gemm.WNA16_KERNEL_MAX_BATCH + 1, K, generator=_gen(7))
    for x in (small, large):
        layer.use_backend("torch")
        out, reference = _both_backends(layer, x)
        torch.testing.assert_close(out, reference, atol=ATOL, rtol=RTOL)
    assert calls == [small.shape]  # the kernel ran for the small batch only


def test_use_gemm_backend_reaches_every_quantized_layer_and_refuses_unknown_names():
    model = torch.nn.Sequential(LAYERS["int8"](), torch.nn.Linear(N, 8), LAYERS["w4a16"]())
    assert use_gemm_backend(model, "triton") == 2
    assert [m.backend for m in model if isinstance(m, QuantLinear)] == ["triton", "triton"]
    with pytest.raises(ValueError, match="choose one of"):
        use_gemm_backend(model, "cutlass")


def test_block_fp8_blocks_the_kernel_does_not_tile_run_the_torch_path():
    """A weight block of 16 columns (the kernels tile 32 or more): the triton backend gives the
    torch path's answer instead of failing at the first request."""
    layer = _fp8_block_layer((16, 16), bias=False)
    layer.prepare(torch.float32)
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(3))
    want = layer(x)
    layer.use_backend("triton")
    assert torch.equal(layer(x), want)

"""kernels/moe_weights.py: stacked quantized experts (their validation and dequantization)
and fused_moe_ref over them: weight-only experts give the float reference on their
dequantized weights, W8A8 experts give a token-by-token loop whose activations go through the
per-token (or static) quantizers of fp8_gemm / int8_gemm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbatch.engine.quant.linear import Fp8BlockLinear
from kvbatch.kernels.fp8_gemm import (
    FP8_DTYPE,
    quantize_fp8_per_token_reference,
    quantize_fp8_static_reference,
)
from kvbatch.kernels.fused_moe import fused_moe_ref
from kvbatch.kernels.int8_gemm import quantize_int8_per_token_reference
from kvbatch.kernels.moe_weights import (
    Fp8BlockExperts,
    W8A8Experts,
    WNA16Experts,
    expert_shape,
    reference_expert_linear,
)
from kvbatch.kernels.wna16_gemm import dequantize_wna16
from tests.kernels.conftest import generator, randn
from tests.kernels.quantized_experts import random_w8a8_experts, random_wna16_experts

# K of both projections is ragged for the packing: 34 and 20 are not multiples of 8 (4-bit)
# and 34 is not one of 4 (8-bit).
HIDDEN, INTER, NUM_EXPERTS = 34, 20, 5


def wna16_experts(
    n: int, k: int, bits: int, group_size: int, *, act_order: bool, sym: bool, seed: int
) -> WNA16Experts:
    return random_wna16_experts(
        NUM_EXPERTS, n, k, bits, group_size, act_order=act_order, sym=sym, gen=generator(seed)
    )


def w8a8_experts(n: int, k: int, kind: str, seed: int) -> W8A8Experts:
    return random_w8a8_experts(NUM_EXPERTS, n, k, kind, gen=generator(seed))


def routing(num_tokens: int, top_k: int, seed: int):
    g = generator(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:top_k] for _ in range(num_tokens)])
    w = torch.rand(ids.shape, generator=g) + 0.1
    return w / w.sum(-1, keepdim=True), ids


def fake_quantize(rows: torch.Tensor, kind: str, static_scale: torch.Tensor | None):
    """rows through the activation quantizer of a dense W8A8 layer and back (float32)."""
    if kind == "int8":
        q, scale = quantize_int8_per_token_reference(rows)
    elif kind == "fp8-static":
        scale = static_scale.reshape(1, 1)
        q = quantize_fp8_static_reference(rows, scale)
    else:
        q, scale = quantize_fp8_per_token_reference(rows)
    return q.float() * scale


def w8a8_token_loop(x, gate_up: W8A8Experts, down: W8A8Experts, topk_weights, topk_ids, kind):
    """Token by token, slot by slot: each expert's projections on fake-quantized activations."""
    out = torch.zeros(x.shape[0], HIDDEN)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            s_up = gate_up.input_scale[e] if gate_up.input_scale is not None else None
            s_down = down.input_scale[e] if down.input_scale is not None else None
            w_gate_up = gate_up.weight[e].float() * gate_up.weight_scale[e]
            w_down = down.weight[e].float() * down.weight_scale[e]
            h = fake_quantize(x[t : t + 1], kind, s_up) @ w_gate_up.T
            act = F.silu(h[:, :INTER]) * h[:, INTER:]
            out[t] += w * (fake_quantize(act, kind, s_down) @ w_down.T)[0]
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    "group_size, act_order, sym",
    [(8, False, False), (8, True, False), (None, False, True), (12, True, True)],
    ids=["grouped-asym", "act-order-asym", "one-group-sym", "act-order-sym"],
)
def test_wna16_reference_is_the_float_reference_on_dequantized_weights(
    bits, group_size, act_order, sym
):
    gate_up = wna16_experts(
        2 * INTER, HIDDEN, bits, group_size or HIDDEN, act_order=act_order, sym=sym, seed=1
    )
    down = wna16_experts(
        HIDDEN, INTER, bits, group_size or INTER, act_order=act_order, sym=sym, seed=2
    )
    x = randn(11, HIDDEN, gen=generator(3), dtype=torch.float32, device="cpu")
    topk_weights, topk_ids = routing(11, 2, seed=4)

    out = fused_moe_ref(x, gate_up, down, topk_weights, topk_ids)

    floats = gate_up.dequantize(torch.float32), down.dequantize(torch.float32)
    assert torch.equal(out, fused_moe_ref(x, *floats, topk_weights, topk_ids))


def test_wna16_dequantize_follows_the_canonical_formula():
    """[E, N, K]: expert e's dequantize_wna16 [K, N], transposed, per expert."""
    experts = wna16_experts(2 * INTER, HIDDEN, 4, 8, act_order=True, sym=False, seed=5)
    w = experts.dequantize(torch.float32)
    assert w.shape == (NUM_EXPERTS, 2 * INTER, HIDDEN)
    for e in range(NUM_EXPERTS):
        by_hand = dequantize_wna16(
            experts.qweight[e], experts.scales[e], experts.zeros[e], experts.g_idx[e], 8, 4, HIDDEN
        )
        assert torch.equal(w[e], by_hand.T)


@pytest.mark.parametrize("kind", ["fp8-dynamic", "fp8-static", "int8"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_w8a8_reference_quantizes_activations_per_expert(kind, top_k):
    gate_up = w8a8_experts(2 * INTER, HIDDEN, kind, seed=6)
    down = w8a8_experts(HIDDEN, INTER, kind, seed=7)
    x = randn(9, HIDDEN, gen=generator(8), dtype=torch.float32, device="cpu")
    topk_weights, topk_ids = routing(9, top_k, seed=9)

    out = fused_moe_ref(x, gate_up, down, topk_weights, topk_ids)

    expected = w8a8_token_loop(x, gate_up, down, topk_weights, topk_ids, kind)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the activations' round trip is visible: float experts on the same weights differ
    floats = gate_up.dequantize(torch.float32), down.dequantize(torch.float32)
    assert not torch.allclose(out, fused_moe_ref(x, *floats, topk_weights, topk_ids), atol=1e-5)


def test_a_quantized_and_a_float_projection_mix():
    """gate|up weight-only, down float: each projection computes in its own format."""
    gate_up = wna16_experts(2 * INTER, HIDDEN, 4, 8, act_order=False, sym=True, seed=10)
    down = randn(NUM_EXPERTS, HIDDEN, INTER, gen=generator(11), dtype=torch.float32, device="cpu")
    x = randn(6, HIDDEN, gen=generator(12), dtype=torch.float32, device="cpu")
    topk_weights, topk_ids = routing(6, 2, seed=13)
    out = fused_moe_ref(x, gate_up, down, topk_weights, topk_ids)
    expected = fused_moe_ref(x, gate_up.dequantize(torch.float32), down, topk_weights, topk_ids)
    assert torch.equal(out, expected)


def test_shapes_and_properties():
    wna16 = wna16_experts(2 * INTER, HIDDEN, 8, 8, act_order=False, sym=True, seed=14)
    w8a8 = w8a8_experts(HIDDEN, INTER, "fp8-static", seed=15)
    assert (wna16.num_experts, wna16.out_features, wna16.in_features) == (5, 40, 34)
    assert expert_shape(wna16) == (5, 40, 34)
    assert (w8a8.num_experts, w8a8.out_features, w8a8.in_features) == (5, 34, 20)
    assert w8a8.dequantize(torch.float16).shape == (5, 34, 20)
    assert w8a8.dequantize(torch.float16).dtype == torch.float16


def _replace(experts, **fields):
    return type(experts)(**{**experts.__dict__, **fields})


def test_wna16_validation_errors_are_named():
    good = wna16_experts(2 * INTER, HIDDEN, 4, 8, act_order=True, sym=False, seed=16)
    with pytest.raises(ValueError, match="bits must be one of"):
        _replace(good, bits=3)
    with pytest.raises(ValueError, match="in_features = 50 needs 7"):
        _replace(good, in_features=50)
    with pytest.raises(ValueError, match="qweight must be int32"):
        _replace(good, qweight=good.qweight.float())
    with pytest.raises(ValueError, match=r"must both be \[5, G, 40\]"):
        _replace(good, zeros=good.zeros[:, :1])
    with pytest.raises(ValueError, match=r"g_idx must be int32 \[5, 34\]"):
        _replace(good, g_idx=good.g_idx[:, :-1])
    with pytest.raises(ValueError, match="groups of 4 cover 20"):
        _replace(good, g_idx=None, group_size=4)


def test_w8a8_validation_errors_are_named():
    fp8 = w8a8_experts(HIDDEN, INTER, "fp8-static", seed=17)
    int8 = w8a8_experts(HIDDEN, INTER, "int8", seed=18)
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        _replace(fp8, weight=fp8.weight.float())
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[5, 34, 1\]"):
        _replace(fp8, weight_scale=fp8.weight_scale[:, :, 0])
    with pytest.raises(ValueError, match=r"input_scale must be float32 \[5\]"):
        _replace(fp8, input_scale=fp8.input_scale[:1])
    with pytest.raises(ValueError, match="input_scale must be None"):
        _replace(int8, input_scale=fp8.input_scale)


def test_fused_moe_ref_names_disagreeing_expert_shapes():
    gate_up = wna16_experts(2 * INTER, HIDDEN, 4, 8, act_order=False, sym=True, seed=19)
    down = w8a8_experts(HIDDEN, INTER + 1, "int8", seed=20)
    x = torch.zeros(3, HIDDEN)
    ids = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="weight shapes disagree"):
        fused_moe_ref(x, gate_up, down, ids.float(), ids)


def _fp8_block_experts(seed: int) -> Fp8BlockExperts:
    g = generator(seed)
    weight = (torch.randn(3, 40, HIDDEN, generator=g) * 60).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(3, 3, 2, generator=g) * 1e-3 + 1e-4  # blocks of [16, 32], partial
    return Fp8BlockExperts(weight, scale, 16, 32)


def test_fp8_block_reference_is_the_dense_block_layers_answer():
    """Each expert computes what a dense block FP8 layer with its tensors computes on the
    CPU path (engine/quant: blocks dequantized, activations through per-group FP8)."""
    w = _fp8_block_experts(21)
    rows = randn(7, HIDDEN, gen=generator(22), dtype=torch.float32, device="cpu")
    for e in range(w.num_experts):
        dense = Fp8BlockLinear(w.weight[e], w.weight_scale[e], w.block, None)
        dense.prepare(torch.float32)
        # equal up to the GEMM's rounding (the CPU's GEMM rounds by the operands' alignment)
        torch.testing.assert_close(
            reference_expert_linear(rows, w, e), dense(rows), rtol=1e-6, atol=1e-6
        )
    assert expert_shape(w) == (3, 40, HIDDEN)


def test_fp8_block_validation_errors_are_named():
    w = _fp8_block_experts(23)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[3, 3, 2\]"):
        Fp8BlockExperts(w.weight, w.weight_scale[:, :2], 16, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8BlockExperts(w.weight.float(), w.weight_scale, 16, 32)

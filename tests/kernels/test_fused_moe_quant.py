"""kernels/fused_moe_quant.py through fused_moe: the grouped GEMMs on quantized experts
(weight-only 4/8-bit, FP8 dynamic and static, int8, block-scaled FP8) against fused_moe_ref, whose quantized
experts compute as the dense quantized layers do (tests/kernels/test_moe_weights.py).

Uneven loads (experts with no tokens, one expert taking every token), top-1 to top-4, token
counts that are not a multiple of the block. On the CPU the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py sets it), which mishandles bfloat16 dots: float32, and
float16 for weight-only experts (whose answers are smooth in the activations; a W8A8 layer's
activation rounding can flip on the last bit of a float16 input, so it is checked in float32).
"""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.fp8_gemm import FP8_DTYPE
from kvbatch.kernels.fused_moe import fused_moe, fused_moe_ref
from kvbatch.kernels.fused_moe_quant import fp8_block_grouped_gemm, w8a8_grouped_gemm
from kvbatch.kernels.moe_blocks import align_to_blocks
from kvbatch.kernels.moe_weights import Fp8BlockExperts, reference_expert_linear
from tests.kernels.conftest import assert_close, generator, randn
from tests.kernels.quantized_experts import (
    W8A8_KINDS,
    random_w8a8_experts,
    random_wna16_experts,
)

# K of both projections is ragged: 34 and 20 are not multiples of 8 (4-bit words) or of the
# K tile, and 34 is not one of 4 (8-bit words).
HIDDEN, INTER = 34, 20

ROUTINGS = {
    # name: (num_tokens, top_k, num_experts, ids or None for random distinct ones)
    "top2-uneven": (13, 2, 6, None),
    "top1": (21, 1, 4, None),
    "top4": (5, 4, 8, None),
    "one-expert-takes-all": (19, 1, 4, torch.full((19, 1), 2)),
    "idle-experts": (17, 2, 8, torch.tensor([[1, 6]] * 9 + [[6, 1]] * 8)),
}

WNA16_FORMATS = {
    # name: (group_size or None for one group over K, act_order, symmetric zeros)
    "grouped-asym": (8, False, False),
    "act-order-asym": (8, True, False),
    "one-group-sym": (None, False, True),
    "act-order-sym": (4, True, True),
}


def routing(case: str, device):
    num_tokens, top_k, num_experts, ids = ROUTINGS[case]
    g = generator(1)
    if ids is None:
        ids = torch.stack(
            [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]
        )
    w = torch.rand(ids.shape, generator=g) + 0.1
    return num_experts, (w / w.sum(-1, keepdim=True)).to(device), ids.to(device)


def wna16_pair(num_experts, bits, fmt, dtype, device, hidden=HIDDEN, inter=INTER):
    group_size, act_order, sym = WNA16_FORMATS[fmt] if isinstance(fmt, str) else fmt
    g = generator(2)
    kw = dict(act_order=act_order, sym=sym, gen=g, dtype=dtype, device=device)
    gate_up = random_wna16_experts(num_experts, 2 * inter, hidden, bits, group_size or hidden, **kw)
    down = random_wna16_experts(num_experts, hidden, inter, bits, group_size or inter, **kw)
    return gate_up, down


def random_fp8_block_experts(num_experts, n, k, block, *, gen, device) -> Fp8BlockExperts:
    """Random float experts [E, N, K] quantized per [block_n, block_k] tile (absmax / 448),
    the last tiles partial where N or K is ragged."""
    bn, bk = block
    w = torch.randn(num_experts, n, k, generator=gen) * 0.2
    padded = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
    tiles = padded.unflatten(2, (-1, bk)).unflatten(1, (-1, bn))  # [E, NB, bn, KB, bk]
    scale = tiles.abs().amax((2, 4)) / 448.0  # [E, NB, KB]
    full = scale.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
    weight = (w / full).clamp(-448, 448).to(FP8_DTYPE)
    return Fp8BlockExperts(weight.to(device), scale.float().to(device), bn, bk)


def check_grouped_gemm_rows(gemm, w, topk_weights, topk_ids, seed: int) -> None:
    """Both of a step's GEMMs through `gemm` on the same activations as the reference (so no
    rounding tie can part them): gate|up reads row p // k of x, down reads row p and applies
    the routing weight; every pair's row equals its expert's dense layer's."""
    num_tokens, top_k = topk_ids.shape
    device, n = topk_ids.device, w.out_features
    flat_ids = topk_ids.reshape(-1).tolist()
    route_w = topk_weights.reshape(-1).float().contiguous()
    blocks = align_to_blocks(topk_ids, w.num_experts, block_m=16)
    x = randn(num_tokens, HIDDEN, gen=generator(seed), dtype=torch.float32, device=device)
    act = randn(
        num_tokens * top_k, HIDDEN, gen=generator(seed + 1), dtype=torch.float32, device=device
    )
    for a, a_row_div, weights in [(x, top_k, None), (act, 1, route_w)]:
        out = torch.full((num_tokens * top_k, n), float("nan"), device=device)
        gemm(a, w, out, weights, blocks, a_row_div)
        expected = torch.stack(
            [
                reference_expert_linear(a[p // a_row_div][None], w, e)[0]
                for p, e in enumerate(flat_ids)
            ]
        )
        if weights is not None:
            expected = expected * weights[:, None]
        assert_close(out, expected, torch.float32)


def check_against_reference(x, gate_up, down, topk_weights, topk_ids, **kw):
    out = fused_moe(x, gate_up, down, topk_weights, topk_ids, **kw)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    expected = fused_moe_ref(x, gate_up, down, topk_weights, topk_ids)
    assert expected.abs().max() > 0.05  # the experts' answers are not vanishingly small
    if getattr(down, "is_int8", False):
        assert_close_but_for_int8_ties(out, expected)
    else:
        assert_close(out, expected, x.dtype)


def assert_close_but_for_int8_ties(out, expected):
    """compressed-tensors' int8 scale maps a row's largest magnitude to 127.5, so when that
    value is negative it lands on a rounding tie (-127.5: -128 or -127 on the last bit). The
    down projection's activations come out of a GEMM and a SiLU whose last bits follow their
    summation order, so the kernel and the reference may round that one element apart: a
    token's output then moves by one int8 step of one activation (about 2e-3 here). Most
    tokens match tightly, every token within such a step."""
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=0)
    tight = torch.isclose(out, expected, atol=1e-4, rtol=1e-4).all(dim=1)
    assert tight.float().mean() >= 0.75, f"only {int(tight.sum())} of {len(tight)} tokens match"


@pytest.mark.parametrize("fmt", WNA16_FORMATS)
@pytest.mark.parametrize("bits", [4, 8])
def test_wna16_experts_match_the_reference(device, bits, fmt):
    num_experts, topk_weights, topk_ids = routing("top2-uneven", device)
    gate_up, down = wna16_pair(num_experts, bits, fmt, torch.float32, device)
    x = randn(len(topk_ids), HIDDEN, gen=generator(3), dtype=torch.float32, device=device)
    check_against_reference(x, gate_up, down, topk_weights, topk_ids)


@pytest.mark.parametrize("case", ROUTINGS)
def test_wna16_experts_under_uneven_loads(device, case):
    num_experts, topk_weights, topk_ids = routing(case, device)
    gate_up, down = wna16_pair(num_experts, 4, "act-order-asym", torch.float32, device)
    x = randn(len(topk_ids), HIDDEN, gen=generator(4), dtype=torch.float32, device=device)
    check_against_reference(x, gate_up, down, topk_weights, topk_ids)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["grouped-asym", "act-order-sym"])
def test_wna16_experts_in_each_dtype(device, dtype, bits, fmt):
    """float32 and float16 (and bfloat16 on CUDA): scales and zeros in the activations' dtype,
    the dequantized tile rounded to it before the dot, as the reference rounds its weight."""
    num_experts, topk_weights, topk_ids = routing("top2-uneven", device)
    gate_up, down = wna16_pair(num_experts, bits, fmt, dtype, device)
    x = randn(len(topk_ids), HIDDEN, gen=generator(5), dtype=dtype, device=device)
    check_against_reference(x, gate_up, down, topk_weights, topk_ids)


@pytest.mark.parametrize("bits", [4, 8])
def test_wna16_groups_spanning_whole_k_tiles(device, bits):
    """Hidden 256 and intermediate 136 with groups of 128: without g_idx each K tile (128 wide
    under the interpreter, 64 compiled) lies in one group, which the kernel loads once per
    tile; the down projection's last tile is ragged and the N tiles are several."""
    num_experts, topk_weights, topk_ids = routing("top2-uneven", device)
    gate_up, down = wna16_pair(
        num_experts, bits, (128, False, False), torch.float32, device, hidden=256, inter=136
    )
    x = randn(len(topk_ids), 256, gen=generator(6), dtype=torch.float32, device=device)
    check_against_reference(x, gate_up, down, topk_weights, topk_ids)


@pytest.mark.parametrize("case", ROUTINGS)
@pytest.mark.parametrize("kind", W8A8_KINDS)
def test_w8a8_grouped_gemm_matches_each_experts_dense_layer(device, kind, case):
    """Both GEMMs on the same activations as the reference (so no rounding tie can part
    them): gate|up reads row p // k of x, down reads row p and applies the routing weight."""
    num_experts, topk_weights, topk_ids = routing(case, device)
    w = random_w8a8_experts(num_experts, 24, HIDDEN, kind, gen=generator(13), device=device)
    check_grouped_gemm_rows(w8a8_grouped_gemm, w, topk_weights, topk_ids, seed=14)


@pytest.mark.parametrize("case", ROUTINGS)
@pytest.mark.parametrize("kind", W8A8_KINDS)
def test_w8a8_experts_match_the_reference(device, kind, case):
    num_experts, topk_weights, topk_ids = routing(case, device)
    g = generator(7)
    gate_up = random_w8a8_experts(num_experts, 2 * INTER, HIDDEN, kind, gen=g, device=device)
    down = random_w8a8_experts(num_experts, HIDDEN, INTER, kind, gen=g, device=device)
    x = randn(len(topk_ids), HIDDEN, gen=generator(8), dtype=torch.float32, device=device)
    check_against_reference(x, gate_up, down, topk_weights, topk_ids)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("kind", ["wna16", *W8A8_KINDS])
def test_block_size_does_not_change_the_result(device, kind, block_m):
    """23 tokens: the last block of most experts is partly padding."""
    num_experts, topk_weights, topk_ids = routing("top2-uneven", device)
    topk_weights, topk_ids = topk_weights.repeat(2, 1)[:23], topk_ids.repeat(2, 1)[:23]
    if kind == "wna16":
        gate_up, down = wna16_pair(num_experts, 4, "grouped-asym", torch.float32, device)
    else:
        g = generator(9)
        gate_up = random_w8a8_experts(num_experts, 2 * INTER, HIDDEN, kind, gen=g, device=device)
        down = random_w8a8_experts(num_experts, HIDDEN, INTER, kind, gen=g, device=device)
    x = randn(23, HIDDEN, gen=generator(10), dtype=torch.float32, device=device)
    check_against_reference(x, gate_up, down, topk_weights, topk_ids, block_m=block_m)


@pytest.mark.parametrize("kind", ["wna16", "int8"])
def test_a_token_is_unchanged_by_its_neighbours(device, kind):
    """Per-token activation scales and per-expert weights: a token's output is the same alone
    and in a batch (int8 sums are exact, so any leak across rows would show)."""
    num_experts, topk_weights, topk_ids = routing("top2-uneven", device)
    if kind == "wna16":
        gate_up, down = wna16_pair(num_experts, 8, "act-order-asym", torch.float32, device)
    else:
        g = generator(11)
        gate_up = random_w8a8_experts(num_experts, 2 * INTER, HIDDEN, kind, gen=g, device=device)
        down = random_w8a8_experts(num_experts, HIDDEN, INTER, kind, gen=g, device=device)
    x = randn(len(topk_ids), HIDDEN, gen=generator(12), dtype=torch.float32, device=device)
    batch = fused_moe(x, gate_up, down, topk_weights, topk_ids)
    alone = fused_moe(x[4:5], gate_up, down, topk_weights[4:5], topk_ids[4:5])
    assert torch.equal(batch[4:5], alone)


def test_no_tokens_gives_an_empty_result(device):
    gate_up, down = wna16_pair(4, 4, "grouped-asym", torch.float32, device)
    x = torch.zeros(0, HIDDEN, device=device)
    ids = torch.zeros(0, 2, dtype=torch.long, device=device)
    assert fused_moe(x, gate_up, down, ids.float(), ids).shape == (0, HIDDEN)


# N = 40 and 34 rows in blocks of 16, K = 34 and 20 in blocks of 32: partial tiles both ways
FP8_BLOCK = (16, 32)


@pytest.mark.parametrize("case", ROUTINGS)
def test_fp8_block_grouped_gemm_matches_each_experts_dense_layer(device, case):
    """Both GEMMs on the same activations as the reference: per-group quantization of each
    row of A, each K block scaled by the expert's tile scales."""
    num_experts, topk_weights, topk_ids = routing(case, device)
    w = random_fp8_block_experts(
        num_experts, 40, HIDDEN, FP8_BLOCK, gen=generator(16), device=device
    )
    check_grouped_gemm_rows(fp8_block_grouped_gemm, w, topk_weights, topk_ids, seed=17)


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("case", ["top2-uneven", "top4", "idle-experts"])
def test_fp8_block_experts_match_the_reference(device, case, block_m):
    num_experts, topk_weights, topk_ids = routing(case, device)
    g = generator(19)
    kw = dict(gen=g, device=device)
    gate_up = random_fp8_block_experts(num_experts, 2 * INTER, HIDDEN, FP8_BLOCK, **kw)
    down = random_fp8_block_experts(num_experts, HIDDEN, INTER, FP8_BLOCK, **kw)
    x = randn(len(topk_ids), HIDDEN, gen=generator(20), dtype=torch.float32, device=device)
    check_against_reference(x, gate_up, down, topk_weights, topk_ids, block_m=block_m)


def test_fp8_block_experts_the_kernel_does_not_tile_run_the_reference(device):
    """Blocks of fewer than 32 columns (FP8 dots take K tiles of 32 or more): fused_moe gives
    the reference's answer instead of failing at the first request."""
    num_experts, topk_weights, topk_ids = routing("top2-uneven", device)
    g = generator(31)
    gate_up = random_fp8_block_experts(
        num_experts, 2 * INTER, HIDDEN, (16, 16), gen=g, device=device
    )
    down = random_fp8_block_experts(num_experts, HIDDEN, INTER, (16, 16), gen=g, device=device)
    x = randn(len(topk_ids), HIDDEN, gen=generator(32), dtype=torch.float32, device=device)
    out = fused_moe(x, gate_up, down, topk_weights, topk_ids)
    assert torch.equal(out, fused_moe_ref(x, gate_up, down, topk_weights, topk_ids))

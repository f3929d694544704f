"""kernels/wna16_gemm.py: the W4A16/W8A16 dequantizing GEMM against its reference, and the
reference against a weight dequantized by hand from the canonical layout's definition.

On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it); shapes stay
small because the interpreter runs each program in Python.
"""

from __future__ import annotations

import pytest
import torch

from kvbatch.kernels.wna16_gemm import (
    MIN_K_PER_SPLIT,
    choose_split_k,
    pack_qweight,
    unpack_qweight,
    wna16_gemm,
    wna16_gemm_reference,
)
from tests.kernels.conftest import assert_close, generator

BITS = [4, 8]


def _quantized(K, N, bits, group_size, *, act_order, gen, dtype, device, scale=0.02):
    """Random unsigned values, scales and zero points in the canonical layout; with act_order a
    g_idx that sends each row to a random group (every group used)."""
    groups = -(-K // group_size)
    q = torch.randint(0, 2**bits, (K, N), generator=gen)
    scales = (torch.rand(groups, N, generator=gen) + 0.5) * scale
    zeros = torch.randint(0, 2**bits, (groups, N), generator=gen).float()
    g_idx = None
    if act_order:
        g_idx = (torch.arange(K) // group_size)[torch.randperm(K, generator=gen)].to(torch.int32)
        g_idx = g_idx.to(device)
    return (
        q,
        pack_qweight(q, bits).to(device),
        scales.to(device=device, dtype=dtype),
        zeros.to(device=device, dtype=dtype),
        g_idx,
    )


def _by_hand(x, q, scales, zeros, g_idx, group_size):
    """x @ w from the contract's formula, one row of K at a time."""
    K = q.shape[0]
    w = torch.empty(K, q.shape[1])
    for k in range(K):
        g = int(g_idx[k]) if g_idx is not None else k // group_size
        w[k] = (q[k].float() - zeros[g].float().cpu()) * scales[g].float().cpu()
    return x.float().cpu() @ w.to(x.dtype).float()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "M, K, N, group_size, act_order",
    [
        (1, 128, 64, 32, False),  # one group per K tile and several tiles
        (3, 72, 40, 16, False),  # groups straddle K tiles; N not a multiple of the tile
        (5, 200, 33, 64, False),  # odd N, a partial last group
        (2, 44, 17, 8, True),  # K not a multiple of 8: a half-filled last word
        (17, 96, 70, 32, True),  # act-order over several groups, M past one 16-row tile
        (4, 64, 24, 64, True),  # one group, permuted rows
    ],
)
def test_matches_reference(bits, M, K, N, group_size, act_order, dtype, device):
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("the interpreter mishandles bfloat16 dots")
    gen = generator(M * 1000 + K * 7 + N + bits)
    q, qweight, scales, zeros, g_idx = _quantized(
        K, N, bits, group_size, act_order=act_order, gen=gen, dtype=dtype, device=device
    )
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)

    out = wna16_gemm(x, qweight, scales, zeros, g_idx, group_size, bits)
    ref = wna16_gemm_reference(x, qweight, scales, zeros, g_idx, group_size, bits)

    assert out.dtype == dtype and out.shape == (M, N)
    assert_close(out, ref, dtype)
    assert_close(ref.cpu(), _by_hand(x, q, scales, zeros, g_idx, group_size), dtype)


@pytest.mark.parametrize("split_k", [2, 3, 7])
@pytest.mark.parametrize("act_order", [False, True])
def test_split_k_gives_the_unsplit_result(split_k, act_order, device):
    """K cut into slices (the last short, or fewer slices than asked when K is short), the
    float32 partials summed in order: the unsplit output, the reference's."""
    dtype = torch.float16
    gen = generator(split_k * 10 + act_order)
    K, N, group_size = 200, 40, 32
    _, qweight, scales, zeros, g_idx = _quantized(
        K, N, 4, group_size, act_order=act_order, gen=gen, dtype=dtype, device=device
    )
    x = torch.randn(3, K, generator=gen).to(device=device, dtype=dtype)
    args = (x, qweight, scales, zeros, g_idx, group_size, 4)
    split = wna16_gemm(*args, split_k=split_k)
    assert_close(split, wna16_gemm(*args, split_k=1), dtype)
    assert_close(split, wna16_gemm_reference(*args), dtype)


def test_split_k_choice():
    cpu = torch.device("cpu")  # behaves as a 132-SM GPU
    assert choose_split_k(tiles=64, K=4096, device=cpu) == 4  # batch 1, N 4096
    assert choose_split_k(tiles=64, K=14336, device=cpu) == 4
    assert choose_split_k(tiles=1, K=4096, device=cpu) == 4096 // MIN_K_PER_SPLIT
    assert choose_split_k(tiles=448, K=4096, device=cpu) == 1  # the tiles fill the GPU
    assert choose_split_k(tiles=2, K=300, device=cpu) == 1  # too short to slice


@pytest.mark.parametrize("bits", BITS)
def test_pack_round_trip(bits):
    gen = generator(bits)
    for K in (1, 7, 8, 9, 33):
        q = torch.randint(0, 2**bits, (K, 5), generator=gen)
        packed = pack_qweight(q, bits)
        assert packed.dtype == torch.int32 and packed.shape == (-(-K // (32 // bits)), 5)
        assert torch.equal(unpack_qweight(packed, bits, K), q.to(torch.int32))


def test_gptq_bit_order_of_one_word():
    """Value j of a word in bits [4j, 4j + 4): 0x76543210 holds 0, 1, ..., 7 along K."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_qweight(word, 4, 8).flatten().tolist() == list(range(8))
    top = torch.tensor([[-0x10000000]], dtype=torch.int32)  # 0xF0000000: value 7 is 15
    assert unpack_qweight(top, 4, 8).flatten().tolist() == [0] * 7 + [15]


@pytest.mark.parametrize("bits", BITS)
def test_zero_and_extreme_scales(bits, device):
    """A zero scale gives exact zeros in its group; scales near float16's limits stay finite
    where the true product is finite (float32 dequantization, no overflow in the tile)."""
    dtype = torch.float16
    gen = generator(40 + bits)
    K, N, group_size = 64, 48, 16
    _, qweight, scales, zeros, _ = _quantized(
        K, N, bits, group_size, act_order=False, gen=gen, dtype=dtype, device=device
    )
    scales[:, :16] = 0.0  # zero columns
    scales[1, 16:32] = 6e-8  # float16 subnormal
    scales[2, 32:] = 30.0  # large, with x small so that outputs stay below 65504
    x = (torch.randn(3, K, generator=gen) * 0.01).to(device=device, dtype=dtype)

    out = wna16_gemm(x, qweight, scales, zeros, None, group_size, bits)
    ref = wna16_gemm_reference(x, qweight, scales, zeros, None, group_size, bits)

    assert torch.equal(out[:, :16], torch.zeros_like(out[:, :16]))
    assert torch.isfinite(out).all()
    assert_close(out, ref, dtype)


def test_symmetric_zero_point_is_the_midpoint(device):
    """Symmetric formats store zeros = 2**(bits - 1): q = 8 dequantizes to 0, q = 0 to -8 s."""
    K, N = 16, 16
    q = torch.full((K, N), 8)
    q[0] = 0
    qweight = pack_qweight(q, 4).to(device)
    scales = torch.full((1, N), 0.5, device=device)
    zeros = torch.full((1, N), 8.0, device=device)
    x = torch.zeros(1, K, device=device)
    x[0, 0] = 1.0
    out = wna16_gemm(x, qweight, scales, zeros, None, K, 4)
    assert torch.equal(out, torch.full((1, N), -4.0, device=device))


def test_empty_batch(device):
    qweight = pack_qweight(torch.zeros(32, 8, dtype=torch.int64), 4).to(device)
    scales = torch.ones(1, 8, device=device)
    out = wna16_gemm(torch.empty(0, 32, device=device), qweight, scales, scales, None, 32, 4)
    assert out.shape == (0, 8)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"bits": 3}, "bits must be one of"),
        ({"qweight_rows": 3}, "needs 4"),
        ({"group_size": 8}, "pass the checkpoint's group size"),
        ({"g_idx": torch.zeros(5, dtype=torch.int32)}, r"g_idx must be int32 \[32\]"),
        ({"scales_cols": 7}, r"must both be \[G, 8\]"),
    ],
)
def test_bad_inputs_name_the_fix(change, match, device):
    qweight = pack_qweight(torch.zeros(32, 8, dtype=torch.int64), 4)
    qweight = qweight[: change.get("qweight_rows", 4)].to(device)
    scales = torch.ones(1, change.get("scales_cols", 8), device=device)
    with pytest.raises(ValueError, match=match):
        wna16_gemm(
            torch.zeros(2, 32, device=device),
            qweight,
            scales,
            scales,
            change.get("g_idx"),
            change.get("group_size", 32),
            change.get("bits", 4),
        )

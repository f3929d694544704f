"""The grouped GEMM of kernels/fused_moe.py for MXFP4 experts (gpt-oss as published): the
weights cross memory at 4.25 bits a value and are dequantized in registers.

Each program holds one expert's block of BLOCK_M rows (kernels/moe_blocks.py) and BLOCK_N
output columns; per K tile it loads the [BLOCK_K, BLOCK_N] tile's bytes (two E2M1 codes each,
the low nibble the even input), decodes each code arithmetically,

    code = s eee m (sign, 2-bit exponent, 1-bit mantissa)
    |v|  = m / 2                       e = 0 (0 and the subnormal 0.5)
         = (1 + m / 2) * 2 ** (e - 1)   otherwise (1, 1.5, 2, 3, 4, 6)

multiplies by the group's E8M0 scale 2 ** (scale - 127) (one per 32 inputs: a BLOCK_K of 32 or
more covers whole groups), rounds to the activations' dtype (exact in bf16 and fp16 for the
exponents real weights use) and runs tl.dot with a float32 accumulator. Hopper has no FP4
tensor cores, so the dot runs in bf16; what the format saves is memory traffic, which is what a
MoE decode step is bound by.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.moe_blocks import ExpertBlocks, block_rows, store_rows, tile_nk
from kvbatch.kernels.mxfp4 import MXFP4_GROUP, Mxfp4Experts
from kvbatch.kernels.specialize import step_varying


@triton.jit
def decode_e2m1(code):
    """float32 values of E2M1 codes (int32 0..15)."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    magnitude = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where(code >= 8, -magnitude, magnitude)


@step_varying(ints=("num_pairs",))
def _mxfp4_grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]: row r of pair p is p // A_ROW_DIV
    blocks_ptr,  # uint8 [E, N, K / 32, 16]
    scales_ptr,  # uint8 [E, N, K / 32]
    out_ptr,  # [P, N]
    route_w_ptr,  # [P] float32 (read when MUL_ROUTE_W)
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_se,
    stride_sn,
    stride_om,
    stride_on,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTE_W: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs, valid, a_rows, cols, n_mask = block_rows(
        sorted_pairs_ptr, num_pairs, N, A_ROW_DIV, BLOCK_M, BLOCK_N
    )
    b_base = blocks_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
    s_base = scales_ptr + expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
    a_dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        wk_mask = k_mask[:, None] & n_mask[None, :]
        # a row's groups are contiguous: input k is byte k // 2 of the row's K / 2 bytes
        packed = tl.load(b_base + (ks // 2)[:, None], mask=wk_mask, other=0).to(tl.int32)
        code = tl.where((ks % 2 == 0)[:, None], packed & 15, packed >> 4)
        exponent = tl.load(s_base + (ks // 32)[:, None], mask=wk_mask, other=127)
        scale = tl.exp2(exponent.to(tl.float32) - 127.0)
        w = tl.where(wk_mask, decode_e2m1(code) * scale, 0.0).to(a_dtype)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    store_rows(
        out_ptr, acc, route_w_ptr, pairs, valid, cols, n_mask, stride_om, stride_on, MUL_ROUTE_W
    )


def mxfp4_grouped_gemm(
    a: torch.Tensor,  # [rows, K] activations
    w: Mxfp4Experts,
    out: torch.Tensor,  # [P, N] in a's dtype
    route_w: torch.Tensor | None,  # [P] float32, or None
    blocks: ExpertBlocks,
    a_row_div: int,
) -> None:
    """out[p] = a[p // a_row_div] @ dequantize(w[expert(p)]).T (x route_w[p] when given)."""
    n, k = w.out_features, w.in_features
    groups = w.blocks.shape[2]
    if w.blocks.stride(3) != 1 or (groups > 1 and w.blocks.stride(2) != MXFP4_GROUP // 2):
        raise ValueError("MXFP4 blocks must be contiguous along each row's groups")
    if groups > 1 and w.scales.stride(2) != 1:
        raise ValueError("MXFP4 scales must be contiguous along each row's groups")
    block_n, block_k = tile_nk(n, k)
    block_k = max(block_k, MXFP4_GROUP)
    _mxfp4_grouped_gemm_kernel[(blocks.block_experts.numel(), triton.cdiv(n, block_n))](
        a, w.blocks, w.scales, out,
        route_w if route_w is not None else out,
        blocks.sorted_pairs, blocks.block_experts, blocks.num_pairs,
        n, k,
        *a.stride(), w.blocks.stride(0), w.blocks.stride(1),
        w.scales.stride(0), w.scales.stride(1), *out.stride(),
        A_ROW_DIV=a_row_div, MUL_ROUTE_W=route_w is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip

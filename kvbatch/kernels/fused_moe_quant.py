"""The grouped GEMM of kernels/fused_moe.py for quantized experts: the same blocks of
BLOCK_M rows, one expert each, with the expert's weight read in its stored format.

- Weight-only 4/8-bit (WNA16Experts): each program unpacks its expert's int32 words along K
  and dequantizes the [BLOCK_K, BLOCK_N] tile in registers, as kernels/wna16_gemm.py does
  for a dense layer (expert e's words, scales, zeros and g_idx at e's stride), and rounds it to
  the activations' dtype before the dot: the weights cross memory at 4 or 8 bits per value.
- W8A8 (W8A8Experts): the GEMM runs on FP8 or int8 operands and applies the scales once to the
  float32 (FP8) or exact int32 (int8) accumulator: acc * a_scale[row] * weight_scale[e, col].
  Dynamic activation scales are per row of A, so A is quantized once per GEMM before the
  launch by fp8_gemm's / int8_gemm's per-token kernels (x [T, H] for gate|up, the SiLU-and-mul
  activations [P, I] for down), whichever experts its rows go to. A static FP8 scale belongs
  to an expert, so the program quantizes its A tile itself with its block's input_scale[e].
- Block FP8 (Fp8BlockExperts): A is quantized once per GEMM per token and group of block_k
  (kernels/fp8_block_gemm.py's kernel); each K tile's FP8 dot is scaled by its rows' group
  scales and the expert's tile scales, weight_scale[e, col // block_n, k // block_k], before
  it is added to the float32 accumulator.

Triton's interpreter multiplies FP8 and int8 tiles on the CPU, so the tests run these dots as
compiled; nothing here reads a value back to the host (a step's launches depend on its shapes
only, as a CUDA graph needs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.fp8_block_gemm import kernel_block_k, quantize_fp8_per_token_group
from kvbatch.kernels.fp8_cast import to_e4m3
from kvbatch.kernels.fp8_gemm import (
    has_fp8_tensor_cores,
    quantize_fp8_per_token,
)
from kvbatch.kernels.int8_gemm import quantize_int8_per_token
from kvbatch.kernels.interpreter import interpreting
from kvbatch.kernels.moe_blocks import ExpertBlocks, block_rows, store_rows, tile_nk
from kvbatch.kernels.moe_weights import Fp8BlockExperts, W8A8Experts, WNA16Experts
from kvbatch.kernels.specialize import step_varying


@step_varying(ints=("num_pairs",))
def _wna16_grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]: row r of pair p is p // A_ROW_DIV
    qweight_ptr,  # [E, ceil(K / P), N] int32
    scales_ptr,  # [E, G, N]
    zeros_ptr,  # [E, G, N]
    g_idx_ptr,  # [E, K] (read only when HAS_G_IDX)
    out_ptr,  # [P, N]
    route_w_ptr,  # [P] float32 (read when MUL_ROUTE_W)
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    group_size,
    stride_am,
    stride_ak,
    stride_qe,
    stride_qk,
    stride_qn,
    stride_se,
    stride_sg,
    stride_sn,
    stride_ze,
    stride_zg,
    stride_zn,
    stride_ge,
    stride_gk,
    stride_om,
    stride_on,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTE_W: tl.constexpr,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,  # no g_idx and group_size % BLOCK_K == 0: one group a tile
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs, valid, a_rows, cols, n_mask = block_rows(
        sorted_pairs_ptr, num_pairs, N, A_ROW_DIV, BLOCK_M, BLOCK_N
    )
    q_base = qweight_ptr + expert * stride_qe
    s_base = scales_ptr + expert * stride_se
    z_base = zeros_ptr + expert * stride_ze
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
        words = tl.load(
            q_base + (ks // PACK)[:, None] * stride_qk + cols[None, :] * stride_qn,
            mask=wk_mask,
            other=0,
        )  # [BLOCK_K, BLOCK_N] int32
        q = ((words >> ((ks % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
        if GROUP_PER_TILE:
            g = k0 // group_size
            s = tl.load(s_base + g * stride_sg + cols * stride_sn, mask=n_mask, other=0.0)
            z = tl.load(z_base + g * stride_zg + cols * stride_zn, mask=n_mask, other=0.0)
            s = s.to(tl.float32)[None, :]
            z = z.to(tl.float32)[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + expert * stride_ge + ks * stride_gk, mask=k_mask, other=0)
            else:
                g = ks // group_size
            g = g[:, None]
            s = tl.load(s_base + g * stride_sg + cols[None, :] * stride_sn, mask=wk_mask)
            z = tl.load(z_base + g * stride_zg + cols[None, :] * stride_zn, mask=wk_mask)
            s = s.to(tl.float32)
            z = z.to(tl.float32)
        # masked entries have q = 0 but arbitrary s, z: zero them so 0 * a never meets inf/nan
        w = tl.where(wk_mask, (q - z) * s, 0.0).to(a_dtype)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    store_rows(
        out_ptr, acc, route_w_ptr, pairs, valid, cols, n_mask, stride_om, stride_on, MUL_ROUTE_W
    )


def wna16_grouped_gemm(
    a: torch.Tensor,  # [rows, K] activations
    w: WNA16Experts,
    out: torch.Tensor,  # [P, N] in a's dtype
    route_w: torch.Tensor | None,  # [P] float32, or None
    blocks: ExpertBlocks,
    a_row_div: int,
) -> None:
    """out[p] = a[p // a_row_div] @ dequantize(w[expert(p)]).T (x route_w[p] when given)."""
    n, k = w.out_features, w.in_features
    block_n, block_k = tile_nk(n, k)
    g_idx = w.g_idx if w.g_idx is not None else w.qweight  # never read without HAS_G_IDX
    _wna16_grouped_gemm_kernel[(blocks.block_experts.numel(), triton.cdiv(n, block_n))](
        a, w.qweight, w.scales, w.zeros, g_idx, out,
        route_w if route_w is not None else out,
        blocks.sorted_pairs, blocks.block_experts, blocks.num_pairs,
        n, k, w.group_size,
        *a.stride(), *w.qweight.stride(), *w.scales.stride(), *w.zeros.stride(),
        *(g_idx.stride() if w.g_idx is not None else (0, 0)), *out.stride(),
        A_ROW_DIV=a_row_div, MUL_ROUTE_W=route_w is not None,
        BITS=w.bits, HAS_G_IDX=w.g_idx is not None,
        GROUP_PER_TILE=w.g_idx is None and w.group_size % block_k == 0,
        PRECISION=_precision(a),
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


@step_varying(ints=("num_pairs",))
def _w8a8_grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]: quantized (dynamic) or in the activations' dtype (STATIC)
    a_scale_ptr,  # [rows of A] float32 per-row scales (dynamic), [E] input scales (STATIC)
    w_ptr,  # [E, N, K] float8_e4m3fn or int8
    w_scale_ptr,  # [E, N] float32
    out_ptr,  # [P, N]
    route_w_ptr,  # [P] float32 (read when MUL_ROUTE_W)
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_ak,
    stride_as,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_om,
    stride_on,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTE_W: tl.constexpr,
    STATIC: tl.constexpr,  # FP8 with the expert's input scale: quantize the A tile here
    INTEGER: tl.constexpr,  # int8 operands: exact int32 accumulator
    ROUND_FIRST: tl.constexpr,  # under the interpreter (kernels/fp8_cast.py)
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
    w_base = w_ptr + expert * stride_we
    if STATIC:
        a_scale = tl.zeros((BLOCK_M,), tl.float32) + tl.load(a_scale_ptr + expert * stride_as)
    else:
        a_scale = tl.load(a_scale_ptr + a_rows * stride_as, mask=valid, other=0.0)
    if INTEGER:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        if STATIC:
            a = tl.clamp(a.to(tl.float32) / a_scale[:, None], -448.0, 448.0)
            a = to_e4m3(a, w_ptr.dtype.element_ty, ROUND_FIRST)
        w = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=(ks[:, None] < K) & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w)
    w_scale = tl.load(w_scale_ptr + expert * stride_se + cols * stride_sn, mask=n_mask, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    store_rows(
        out_ptr, out, route_w_ptr, pairs, valid, cols, n_mask, stride_om, stride_on, MUL_ROUTE_W
    )


def w8a8_grouped_gemm(
    a: torch.Tensor,  # [rows, K] activations
    w: W8A8Experts,
    out: torch.Tensor,  # [P, N] in a's dtype
    route_w: torch.Tensor | None,  # [P] float32, or None
    blocks: ExpertBlocks,
    a_row_div: int,
) -> None:
    """out[p] = quant(a[p // a_row_div]) @ w[expert(p)].T, both scales applied once
    (x route_w[p] when given)."""
    if not w.is_int8 and a.is_cuda and not has_fp8_tensor_cores(a):
        raise NotImplementedError(
            "FP8 experts need a GPU with FP8 in Triton (sm_89+); on older GPUs run "
            "fused_moe_ref or dequantize the experts to the activations' dtype"
        )
    static = w.input_scale is not None
    if static:
        a_in, a_scale = a, w.input_scale
    elif w.is_int8:
        a_in, a_scale = quantize_int8_per_token(a)
    else:
        a_in, a_scale = quantize_fp8_per_token(a)
    a_scale = a_scale.reshape(-1)  # [rows] or [E]
    n, k = w.out_features, w.in_features
    block_n, block_k = tile_nk(n, k)
    block_k = max(32, block_k)  # FP8 and int8 dots take K tiles of 32 or more
    w_scale = w.weight_scale.squeeze(2)  # [E, N]
    _w8a8_grouped_gemm_kernel[(blocks.block_experts.numel(), triton.cdiv(n, block_n))](
        a_in, a_scale, w.weight, w_scale, out,
        route_w if route_w is not None else out,
        blocks.sorted_pairs, blocks.block_experts, blocks.num_pairs,
        n, k,
        *a_in.stride(), a_scale.stride(0), *w.weight.stride(), *w_scale.stride(), *out.stride(),
        A_ROW_DIV=a_row_div, MUL_ROUTE_W=route_w is not None,
        STATIC=static, INTEGER=w.is_int8, ROUND_FIRST=interpreting(),
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


@step_varying(ints=("num_pairs",))
def _fp8_block_grouped_gemm_kernel(
    a_ptr,  # [rows of A, K] fp8
    a_scale_ptr,  # [rows of A, KB] float32 group scales
    w_ptr,  # [E, N, K] fp8
    w_scale_ptr,  # [E, NB, KB] float32 tile scales
    out_ptr,  # [P, N]
    route_w_ptr,  # [P] float32 (read when MUL_ROUTE_W)
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    block_n,
    block_k,
    stride_am,
    stride_ak,
    stride_asm,
    stride_asg,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sg,
    stride_om,
    stride_on,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides block_k: a tile lies in one scale block
):
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    pairs, valid, a_rows, cols, n_mask = block_rows(
        sorted_pairs_ptr, num_pairs, N, A_ROW_DIV, BLOCK_M, BLOCK_N
    )
    w_base = w_ptr + expert * stride_we
    w_scale_rows = w_scale_ptr + expert * stride_se + (cols // block_n) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
            mask=(ks[:, None] < K) & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        kb = k0 // block_k
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm + kb * stride_asg, mask=valid, other=0.0)
        w_s = tl.load(w_scale_rows + kb * stride_sg, mask=n_mask, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    store_rows(
        out_ptr, acc, route_w_ptr, pairs, valid, cols, n_mask, stride_om, stride_on, MUL_ROUTE_W
    )


def fp8_block_grouped_gemm(
    a: torch.Tensor,  # [rows, K] activations
    w: Fp8BlockExperts,
    out: torch.Tensor,  # [P, N] in a's dtype
    route_w: torch.Tensor | None,  # [P] float32, or None
    blocks: ExpertBlocks,
    a_row_div: int,
) -> None:
    """out[p] = quant(a[p // a_row_div]) @ w[expert(p)].T, each K block scaled by its
    activation group scale and weight tile scale (x route_w[p] when given)."""
    if a.is_cuda and not has_fp8_tensor_cores(a):
        raise NotImplementedError(
            "block FP8 experts need a GPU with FP8 in Triton (sm_89+); on older GPUs run "
            "fused_moe_ref or dequantize the experts to the activations' dtype"
        )
    a_q, a_scale = quantize_fp8_per_token_group(a, w.block_k)  # [rows, K], [rows, KB]
    n, k = w.out_features, w.in_features
    block_n = tile_nk(n, k)[0]
    _fp8_block_grouped_gemm_kernel[(blocks.block_experts.numel(), triton.cdiv(n, block_n))](
        a_q, a_scale, w.weight, w.weight_scale, out,
        route_w if route_w is not None else out,
        blocks.sorted_pairs, blocks.block_experts, blocks.num_pairs,
        n, k, w.block_n, w.block_k,
        *a_q.stride(), *a_scale.stride(), *w.weight.stride(), *w.weight_scale.stride(),
        *out.stride(),
        A_ROW_DIV=a_row_div, MUL_ROUTE_W=route_w is not None,
        BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=kernel_block_k(w.block_k),
    )  # fmt: skip


def _precision(a: torch.Tensor) -> str:
    """float32 activations multiply in full precision (the reference's), not TF32."""
    return "ieee" if a.dtype == torch.float32 else "tf32"

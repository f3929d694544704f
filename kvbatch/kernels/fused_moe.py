"""Fused mixture-of-experts: every token's top-k experts in two grouped GEMMs.

A router picks k experts per token; each (token, slot) pair is one row of work. Rather than
one small GEMM per expert (a launch per expert and most of the GPU idle), the pairs are sorted
by expert and each expert's run is padded to a multiple of BLOCK_M, so that every block of
BLOCK_M rows belongs to exactly one expert:

    pairs (t*k + j)   sorted by expert, padded                 blocks of BLOCK_M rows
    t0:e2 t0:e0       [e0 e0 e0 -- | e1 -- -- -- | e2 e2 -- --]  expert of each block:
    t1:e0 t1:e2   ->   1  2  4  P    5  P  P  P    0  3  P  P    [0, 1, 2, -1, ...]
    t2:e0 t2:e1                                                  (P: padding, skipped)

Then one grouped GEMM computes gate|up for every row (a program loads its block's expert id
and multiplies its rows of x by that expert's [2I, H] weight), SiLU-and-mul halves it, and a
second grouped GEMM applies each row's down projection [H, I] and its routing weight. The k
weighted rows of a token are summed in a fixed order (slot 0 first), so the result does not
depend on which tokens share the batch. This is the structure of vLLM's fused_moe and of
MegaBlocks' block-sparse grouping (Gale et al. 2022, arXiv 2211.15841), written for our needs.

The routing is laid out on the device without reading anything back to the host: the padded
length is bounded by num_pairs + num_experts * (BLOCK_M - 1), blocks past the used ones carry
expert -1 and return at once (kernels/moe_blocks.py). A step's grid therefore depends only
on its token count, as a CUDA graph needs.

The experts may be quantized, each projection in its own format (kernels/moe_weights.py):
a float tensor [E, N, K] runs the kernel below; weight-only 4/8-bit experts, FP8/int8 W8A8
experts and block-scaled FP8 experts run its siblings in kernels/fused_moe_quant.py (MXFP4
experts: kernels/fused_moe_mxfp4.py), which read the same blocks and
compute what the format's dense layer computes. fused_moe_ref is the plain-torch answer for
every format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvbatch.kernels.activation import silu_and_mul
from kvbatch.kernels.fp8_block_gemm import kernel_serves_block_k
from kvbatch.kernels.fused_moe_mxfp4 import mxfp4_grouped_gemm
from kvbatch.kernels.fused_moe_quant import (
    fp8_block_grouped_gemm,
    w8a8_grouped_gemm,
    wna16_grouped_gemm,
)
from kvbatch.kernels.moe_activation import ClampedSwiGLU
from kvbatch.kernels.moe_blocks import (
    ExpertBlocks,
    align_to_blocks,
    block_m_for,
    block_rows,
    store_rows,
    tile_nk,
)
from kvbatch.kernels.moe_weights import (
    ExpertWeights,
    Fp8BlockExperts,
    W8A8Experts,
    WNA16Experts,
    expert_shape,
    reference_expert_linear,
)
from kvbatch.kernels.mxfp4 import Mxfp4Experts
from kvbatch.kernels.specialize import step_varying


@step_varying(ints=("num_pairs",))
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]: row r of pair p is p // A_ROW_DIV
    w_ptr,  # [E, N, K]
    out_ptr,  # [P, N]: row p is pair p's output
    route_w_ptr,  # [P] float32 routing weights (read when MUL_ROUTE_W)
    sorted_pairs_ptr,
    block_experts_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
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
    w_base = w_ptr + expert * stride_we
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
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    store_rows(
        out_ptr, acc, route_w_ptr, pairs, valid, cols, n_mask, stride_om, stride_on, MUL_ROUTE_W
    )


def _grouped_gemm(a, w, out, route_w, blocks: ExpertBlocks, a_row_div: int) -> None:
    """out[p] = a[p // a_row_div] @ w[expert(p)].T (x route_w[p] when given), for every pair."""
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = tile_nk(n, k)
    num_blocks = blocks.block_experts.numel()
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(n, block_n))](
        a,
        w,
        out,
        route_w if route_w is not None else out,
        blocks.sorted_pairs,
        blocks.block_experts,
        blocks.num_pairs,
        n,
        k,
        *a.stride(),
        *w.stride(),
        *out.stride(),
        A_ROW_DIV=a_row_div,
        MUL_ROUTE_W=route_w is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=blocks.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w_gate_up: ExpertWeights,  # [E, 2I, H]: gate rows first, then up
    w_down: ExpertWeights,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] routing weights
    topk_ids: torch.Tensor,  # [T, k] expert ids
    *,
    block_m: int | None = None,  # rows per expert block; None: block_m_for
    biases: ExpertBiases | None = None,  # gpt-oss: per-expert biases of both projections
    activation: ClampedSwiGLU | None = None,  # None: SiLU-and-mul
) -> torch.Tensor:  # [T, H], x's dtype
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j].

    With `biases`, each projection adds its expert's bias (the down bias before the routing
    weight multiplies, so it is weighted too); `activation` replaces SiLU-and-mul."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids)
    if not all(_kernel_serves(w) for w in (w_gate_up, w_down)):
        return fused_moe_ref(
            x, w_gate_up, w_down, topk_weights, topk_ids, biases=biases, activation=activation
        )
    t, top_k = topk_ids.shape
    num_experts, two_i, _ = expert_shape(w_gate_up)
    hidden, inter = expert_shape(w_down)[1], two_i // 2
    if t == 0:
        return x.new_zeros(0, hidden)
    num_pairs = t * top_k
    blocks = align_to_blocks(topk_ids, num_experts, block_m or block_m_for(num_pairs, num_experts))
    route_w = topk_weights.reshape(num_pairs).float().contiguous()
    gate_up = x.new_empty(num_pairs, two_i)  # [P, 2I]
    _project(x, w_gate_up, gate_up, None, blocks, a_row_div=top_k)
    pair_experts = topk_ids.reshape(num_pairs).long()
    if biases is not None:
        gate_up += biases.gate_up[pair_experts]
    if activation is None:
        act = silu_and_mul(gate_up[:, :inter], gate_up[:, inter:], out=gate_up[:, :inter])
    else:
        act = activation(gate_up[:, :inter], gate_up[:, inter:]).contiguous()
    down = x.new_empty(num_pairs, hidden)  # [P, H], already weighted
    if biases is None:
        _project(act, w_down, down, route_w, blocks, a_row_div=1)
    else:  # the bias before the routing weight
        _project(act, w_down, down, None, blocks, a_row_div=1)
        down = (down + biases.down[pair_experts]) * route_w[:, None].to(down.dtype)
    return down.view(t, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


@dataclass(frozen=True)
class ExpertBiases:
    """Per-expert biases of the two projections (gpt-oss), in the activations' dtype."""

    gate_up: torch.Tensor  # [E, 2I], gate then up as the weight's rows
    down: torch.Tensor  # [E, H]


def _kernel_serves(w: ExpertWeights) -> bool:
    """Whether the grouped GEMMs take these experts: all but block FP8 with blocks the kernel
    does not tile (fewer than 32 columns), which run the reference."""
    return not isinstance(w, Fp8BlockExperts) or kernel_serves_block_k(w.block_k)


def _project(a, w: ExpertWeights, out, route_w, blocks: ExpertBlocks, a_row_div: int) -> None:
    """One grouped GEMM in the experts' format (float, weight-only, W8A8, block FP8, MXFP4)."""
    if isinstance(w, WNA16Experts):
        wna16_grouped_gemm(a, w, out, route_w, blocks, a_row_div)
    elif isinstance(w, W8A8Experts):
        w8a8_grouped_gemm(a, w, out, route_w, blocks, a_row_div)
    elif isinstance(w, Fp8BlockExperts):
        fp8_block_grouped_gemm(a, w, out, route_w, blocks, a_row_div)
    elif isinstance(w, Mxfp4Experts):
        mxfp4_grouped_gemm(a, w, out, route_w, blocks, a_row_div)
    else:
        _grouped_gemm(a, w, out, route_w, blocks, a_row_div)


def fused_moe_ref(
    x: torch.Tensor,
    w_gate_up: ExpertWeights,
    w_down: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_m: int | None = None,  # accepted for the same signature; the reference has no blocks
    biases: ExpertBiases | None = None,
    activation: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """Plain-torch reference: one dense SwiGLU per expert over the rows routed to it, each row
    scaled by its routing weight, then the k rows of a token summed (float32). Quantized
    experts compute as their dense layers do (reference_expert_linear), and only the experts
    routed to are dequantized (one expert's weight at a time: MXFP4 experts stay packed)."""
    _check(x, w_gate_up, w_down, topk_weights, topk_ids)
    t, top_k = topk_ids.shape
    inter, hidden = expert_shape(w_gate_up)[1] // 2, expert_shape(w_down)[1]
    flat_ids = topk_ids.reshape(-1)
    route_w = topk_weights.reshape(-1).float()
    out = torch.zeros(t * top_k, hidden, dtype=torch.float32, device=x.device)
    for e in flat_ids.unique().tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)  # [n]
        h = reference_expert_linear(x[pairs // top_k], w_gate_up, e)  # [n, 2I]
        if biases is not None:
            h = h + biases.gate_up[e]
        gate, up = h[:, :inter], h[:, inter:]
        act = F.silu(gate) * up if activation is None else activation(gate, up)
        y = reference_expert_linear(act, w_down, e)  # [n, H]
        if biases is not None:
            y = (y + biases.down[e]) * route_w[pairs, None].to(y.dtype)
            out[pairs] = y.float()
        else:
            out[pairs] = y.float() * route_w[pairs, None]
    return out.view(t, top_k, hidden).sum(1).to(x.dtype)


def _check(x, w_gate_up: ExpertWeights, w_down: ExpertWeights, topk_weights, topk_ids) -> None:
    if x.dim() != 2:
        raise ValueError(f"expected x [T, H], got {tuple(x.shape)}")
    e, two_i, h = expert_shape(w_gate_up)
    down_shape = expert_shape(w_down)
    if h != x.shape[1] or two_i % 2 or down_shape != (e, h, two_i // 2):
        raise ValueError(
            f"weight shapes disagree: x {tuple(x.shape)}, w_gate_up {(e, two_i, h)} "
            f"(want [E, 2I, {x.shape[1]}]), w_down {down_shape} (want [E, H, I])"
        )
    float_dtypes = [w.dtype for w in (w_gate_up, w_down) if isinstance(w, torch.Tensor)]
    if any(dtype != x.dtype for dtype in float_dtypes):
        raise ValueError(
            f"x and the float expert weights must share a dtype; got {x.dtype} and "
            f"{', '.join(map(str, float_dtypes))}"
        )
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights and topk_ids must both be [T, k]; got {tuple(topk_weights.shape)} "
            f"and {tuple(topk_ids.shape)}"
        )
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows for {x.shape[0]} tokens")

"""The routing of one MoE step laid out for a grouped GEMM: pairs sorted by expert, each
expert's run padded to whole blocks of BLOCK_M rows, and the tile sizes the grouped GEMMs use
(kernels/fused_moe.py explains the layout; its float and quantized kernels share this)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvbatch.kernels.interpreter import interpreting


@dataclass(frozen=True)
class ExpertBlocks:
    """The routing of one step sorted by expert and padded to blocks of `block_m` rows."""

    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32: pair index t*k + j, or num_pairs
    block_experts: torch.Tensor  # [num_blocks] int32: each block's expert, -1 when unused
    num_pairs: int  # tokens x top_k
    block_m: int


def align_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the (token, slot) pairs of `topk_ids` [T, k] by expert, each expert's run padded to
    a multiple of `block_m`; sizes are upper bounds, so nothing is read back to the host."""
    flat = topk_ids.flatten().long()  # [P]
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.sort(flat, stable=True).indices  # pair ids, grouped by expert
    expert_of = flat[order]
    first_of_expert = counts.cumsum(0) - counts  # where each expert's run starts in `order`
    rank = torch.arange(num_pairs, device=device) - first_of_expert[expert_of]
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_start[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return ExpertBlocks(sorted_pairs, block_experts, num_pairs, block_m)


@triton.jit
def block_rows(
    sorted_pairs_ptr,
    num_pairs,
    N,
    A_ROW_DIV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A grouped GEMM program's rows and columns: the pairs of its block (program 0's index),
    which of them are real (not padding), the row of A each reads (pair // A_ROW_DIV), and its
    output columns (program 1's index) with their mask."""
    block = tl.program_id(0)
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    return pairs, pairs < num_pairs, pairs // A_ROW_DIV, cols, cols < N


@triton.jit
def store_rows(
    out_ptr,
    acc,  # [BLOCK_M, BLOCK_N] float32
    route_w_ptr,
    pairs,
    valid,
    cols,
    n_mask,
    stride_om,
    stride_on,
    MUL_ROUTE_W: tl.constexpr,
):
    """out[pair, col] = acc (x the pair's routing weight when MUL_ROUTE_W), real rows only."""
    if MUL_ROUTE_W:
        acc = acc * tl.load(route_w_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + pairs[:, None] * stride_om + cols[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )


def tile_nk(n: int, k: int) -> tuple[int, int]:
    """BLOCK_N, BLOCK_K: wide tiles under the interpreter (each program costs milliseconds
    whatever its size), GEMM-sized ones when compiled."""
    if interpreting():
        return pow2_between(n, 16, 128), pow2_between(k, 16, 128)
    return 64, 64


def pow2_between(n: int, low: int, high: int) -> int:
    """The power of two at or above n, clamped to [low, high] (tl.dot needs tiles of 16+)."""
    return max(low, min(high, triton.next_power_of_2(n)))


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: 16 when experts average few rows (decode), 64 when they fill blocks."""
    return 16 if num_pairs <= 4 * num_experts or interpreting() else 64

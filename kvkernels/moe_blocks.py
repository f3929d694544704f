"""The routing of one MoE step laid out for a grouped GEMM: pairs sorted by expert, each
expert's run padded to whole blocks of BLOCK_M rows, and the tile sizes the grouped GEMMs use
(kvkernels/fused_moe.py explains the layout; its float and quantized kernels share this)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

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

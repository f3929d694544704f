"""Exact merge of two partial softmax attentions over disjoint key sets.

If out_a = softmax(s_a) @ V_a with lse_a = logsumexp(s_a), and likewise for b, then attention
over the union of the keys is

    lse = logaddexp(lse_a, lse_b)
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

A side with lse -inf saw no keys: its out is ignored (even if it holds garbage) and the other
side is returned as is; both -inf gives zeros and lse -inf. Cascade attention merges a
group's shared-prefix part with each row's private part this way (engine/attention/cascade.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    out_a_ptr,
    lse_a_ptr,
    out_b_ptr,
    lse_b_ptr,
    out_ptr,
    lse_ptr,
    stride_an,
    stride_ah,
    stride_ad,
    stride_la_n,
    stride_la_h,
    stride_bn,
    stride_bh,
    stride_bd,
    stride_lb_n,
    stride_lb_h,
    stride_on,
    stride_oh,
    stride_od,
    stride_lo_n,
    stride_lo_h,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    lse_a = tl.load(lse_a_ptr + n * stride_la_n + offs_h * stride_la_h, mask=h_mask, other=0.0)
    lse_b = tl.load(lse_b_ptr + n * stride_lb_n + offs_h * stride_lb_h, mask=h_mask, other=0.0)
    a = tl.load(
        out_a_ptr + n * stride_an + offs_h[:, None] * stride_ah + offs_d[None, :] * stride_ad,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    b = tl.load(
        out_b_ptr + n * stride_bn + offs_h[:, None] * stride_bh + offs_d[None, :] * stride_bd,
        mask=mask,
        other=0.0,
    ).to(tl.float32)

    a_empty = lse_a == float("-inf")
    b_empty = lse_b == float("-inf")
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(a_empty & b_empty, 0.0, m)
    w_a = tl.where(a_empty, 0.0, tl.exp(lse_a - m))
    w_b = tl.where(b_empty, 0.0, tl.exp(lse_b - m))
    total = w_a + w_b  # >= 1 unless both sides are empty
    safe_total = tl.where(total == 0.0, 1.0, total)
    lse = tl.where(total == 0.0, float("-inf"), m + tl.log(safe_total))
    # where, not multiply: an empty side's out may be NaN or garbage.
    a = tl.where(a_empty[:, None], 0.0, a * (w_a / safe_total)[:, None])
    b = tl.where(b_empty[:, None], 0.0, b * (w_b / safe_total)[:, None])
    tl.store(
        out_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
        (a + b).to(out_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(lse_ptr + n * stride_lo_n + offs_h * stride_lo_h, lse, mask=h_mask)


def _check(out_a, lse_a, out_b, lse_b) -> None:
    if out_a.dim() != 3 or out_a.shape != out_b.shape:
        raise ValueError(
            f"out_a and out_b must both be [N, H, D]; got {tuple(out_a.shape)} and "
            f"{tuple(out_b.shape)}"
        )
    if lse_a.shape != out_a.shape[:2] or lse_b.shape != out_a.shape[:2]:
        raise ValueError(
            f"lse_a and lse_b must be [N, H] = {tuple(out_a.shape[:2])}; got "
            f"{tuple(lse_a.shape)} and {tuple(lse_b.shape)}"
        )


def merge_attention_states(
    out_a: torch.Tensor,  # [N, H, D]
    lse_a: torch.Tensor,  # [N, H] float32, natural log
    out_b: torch.Tensor,  # [N, H, D]
    lse_b: torch.Tensor,  # [N, H]
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions; returns (out [N, H, D] in out_a's dtype, lse [N, H] f32).

    `out` may alias out_a or out_b (each element is read before it is written).
    """
    _check(out_a, lse_a, out_b, lse_b)
    num_rows, num_heads, head_dim = out_a.shape
    if out is None:
        out = torch.empty_like(out_a)
    lse = torch.empty(num_rows, num_heads, dtype=torch.float32, device=out_a.device)
    if num_rows == 0:
        return out, lse
    block_h = min(16, triton.next_power_of_2(num_heads))
    grid = (num_rows, triton.cdiv(num_heads, block_h))
    _merge_kernel[grid](
        out_a, lse_a, out_b, lse_b, out, lse,
        *out_a.stride(), *lse_a.stride(), *out_b.stride(), *lse_b.stride(),
        *out.stride(), *lse.stride(),
        num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip
    return out, lse


def merge_attention_states_ref(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch merge (float32 math), same contract as the kernel."""
    _check(out_a, lse_a, out_b, lse_b)
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)  # -inf when both are -inf
    finite = lse.nan_to_num(neginf=0.0)
    a_empty, b_empty = (lse_a == float("-inf"))[..., None], (lse_b == float("-inf"))[..., None]
    a = torch.where(a_empty, 0.0, out_a.float() * torch.exp(lse_a - finite)[..., None])
    b = torch.where(b_empty, 0.0, out_b.float() * torch.exp(lse_b - finite)[..., None])
    merged = (a + b).to(out_a.dtype)
    if out is not None:
        out.copy_(merged)
        merged = out
    return merged, lse

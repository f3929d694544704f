"""INT8 W8A8: symmetric per-token activation quantization and the scaled INT8 GEMM.

    x ~= q * scale,   scale = max(absmax(row) / 127.5, MIN_SCALE),
    q = round(clamp(x / scale, -128, 127))

compressed-tensors' convention (the writer of INT8 W8A8 checkpoints, and the engine's CPU
path, engine/quant/qdq.py): the largest magnitude maps to half the 256-value range, and
rounding is to nearest, ties to even (torch.round). The kernel rounds with the float32
magic-number trick, (v + 1.5 * 2**23) - 1.5 * 2**23, exact round-half-even for |v| < 2**22,
so that kernel and reference agree to the bit. The GEMM
accumulates exactly in int32 (K * 128 * 128 stays below 2**31 for any K under 131,000), then
applies the per-token and per-channel scales once (kernels/scaled_mm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.interpreter import rows_per_program
from kvbatch.kernels.scaled_mm import (
    check_scaled_mm_inputs,
    launch_scaled_mm,
    scaled_mm_reference,
)
from kvbatch.kernels.specialize import step_varying

INT8_MIN, INT8_MAX = -128.0, 127.0
INT8_HALF_RANGE = 127.5  # (INT8_MAX - INT8_MIN) / 2
MIN_SCALE = float(torch.finfo(torch.float32).tiny)  # an all-zero row quantizes to zeros


@step_varying(ints=("num_rows",))
def _quantize_int8_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] int8
    scale_ptr,  # [M] float32
    num_rows,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_rows
    amax = tl.zeros([ROWS], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask)
        amax = tl.maximum(amax, tl.max(tl.where(mask, tl.abs(x.to(tl.float32)), 0.0), 1))
    scale = tl.maximum(amax / 127.5, 1.1754943508222875e-38)
    tl.store(scale_ptr + rows, scale, mask=row_mask)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask)
        v = tl.clamp(x.to(tl.float32) / scale[:, None], -128.0, 127.0)
        q = (v + 12582912.0) - 12582912.0  # round half to even (see the module docstring)
        tl.store(
            q_ptr + rows[:, None] * stride_qm + cols[None, :] * stride_qk,
            q.to(tl.int8),
            mask=mask,
        )


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic per-token quantization: (q int8 [M, K], scale [M, 1] float32)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    num_rows, K = x.shape
    q = torch.empty(num_rows, K, dtype=torch.int8, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0 or K == 0:
        return q, scale.fill_(MIN_SCALE)
    rows = rows_per_program()
    _quantize_int8_kernel[(triton.cdiv(num_rows, rows),)](
        x, q, scale, num_rows, K, *x.stride(), *q.stride(),
        ROWS=rows, BLOCK_K=min(1024, triton.next_power_of_2(K)),
    )  # fmt: skip
    return q, scale


def quantize_int8_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same arithmetic as the kernel (and as compressed-tensors)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    amax = x.float().abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(len(x), 1)
    scale = torch.clamp(amax.float() / INT8_HALF_RANGE, min=MIN_SCALE)
    q = (x.float() / scale).clamp(INT8_MIN, INT8_MAX).round()
    return q.to(torch.int8), scale


def int8_scaled_mm(
    a: torch.Tensor,  # [M, K] int8
    a_scale: torch.Tensor,  # [M, 1] (or [1, 1]) float32
    b: torch.Tensor,  # [N, K] int8
    b_scale: torch.Tensor,  # [N, 1] (or [1, 1]) float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] out_dtype
    """(a @ b.T) exact in int32, then * a_scale * b_scale.T + bias in float32."""
    check_scaled_mm_inputs(a, a_scale, b, b_scale, bias, torch.int8)
    return launch_scaled_mm(a, a_scale, b, b_scale, out_dtype, bias)


def int8_scaled_mm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: exact integer products (float64), then the scales and bias in float32."""
    check_scaled_mm_inputs(a, a_scale, b, b_scale, bias, torch.int8)
    return scaled_mm_reference(a.float(), a_scale, b.float(), b_scale, out_dtype, bias)

"""RMSNorm (with the residual add before it) fused with FP8 per-token quantization: the input
of an FP8 W8A8 qkv or gate_up projection in one pass over the row.

Unfused, the normalised row is written in the activation dtype, then read twice by
quantize_fp8_per_token (absmax, then quantize) and written again as FP8. A whole row
(hidden up to 8192) fits in one block, so here it stays in registers: normalised, its absmax
taken, quantized and stored once. The arithmetic is exactly the composition of the two
references (kernels/rms_norm.py, then kernels/fp8_gemm.py):

    y = weight * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(dtype)      rounded to x's dtype
    scale = max(absmax(y) / 448, MIN_SCALE);  q = E4M3(clamp(y / scale, +-448))

SiLU-and-mul is not fused the same way: its rows (the intermediate size, up to 28672) do not
fit one block, and a two-pass fusion reads gate and up twice, about what it saves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.fp8_cast import to_e4m3
from kvbatch.kernels.fp8_gemm import (
    FP8_DTYPE,
    has_fp8_tensor_cores,
    quantize_fp8_per_token_reference,
)
from kvbatch.kernels.interpreter import interpreting, rows_per_program
from kvbatch.kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kvbatch.kernels.specialize import step_varying

MAX_HIDDEN = 8192  # one row per block


@step_varying(ints=("num_rows",))
def _rms_norm_quant_kernel(
    x_ptr,
    residual_ptr,  # read and updated (residual += x) when HAS_RESIDUAL
    weight_ptr,
    q_ptr,  # [T, hidden] fp8
    scale_ptr,  # [T] float32
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_q,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_FIRST: tl.constexpr,  # under the interpreter (kernels/fp8_cast.py)
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row_ids = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    rows = row_ids[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (rows < num_rows) & (cols < hidden)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        dtype = r.dtype
        x = (r.to(tl.float32) + x.to(tl.float32)).to(dtype)  # as `residual += x` rounds
        tl.store(residual_ptr + rows * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=1)[:, None] / hidden
    normed = (x32 * tl.rsqrt(mean_sq + eps)).to(dtype)
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(dtype)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(dtype).to(tl.float32)  # [ROWS, BLOCK]
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1)  # [ROWS]
    scale = tl.maximum(amax / 448.0, 1.1754943508222875e-38)  # MIN_SCALE: float32 tiny
    tl.store(scale_ptr + row_ids, scale, mask=row_ids < num_rows)
    q = tl.clamp(y / scale[:, None], -448.0, 448.0)
    tl.store(
        q_ptr + rows * stride_q + cols, to_e4m3(q, q_ptr.dtype.element_ty, ROUND_FIRST), mask=mask
    )


def rms_norm_quant_fp8(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden], updated in place (residual += x)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, hidden] float8_e4m3fn, scale [T, 1] float32) of rms_norm(x) (of residual + x
    when a residual is given, which then holds the sum)."""
    _check(x, weight, residual)
    num_rows, hidden = x.shape
    if x.is_cuda and not has_fp8_tensor_cores(x):  # no FP8 in Triton before sm_89
        return rms_norm_quant_fp8_reference(x, weight, eps, residual)
    q = torch.empty(num_rows, hidden, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    block = triton.next_power_of_2(hidden)
    rows = rows_per_program()
    _rms_norm_quant_kernel[(triton.cdiv(num_rows, rows),)](
        x, x if residual is None else residual, weight, q, scale,
        num_rows, hidden, eps,
        x.stride(0), 0 if residual is None else residual.stride(0), q.stride(0),
        HAS_RESIDUAL=residual is not None, ROUND_FIRST=interpreting(), ROWS=rows, BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )  # fmt: skip
    return q, scale


def rms_norm_quant_fp8_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: the RMSNorm reference, then per-token quantization of its output."""
    _check(x, weight, residual)
    if residual is None:
        y = rms_norm_ref(x, weight, eps)
    else:
        y, _ = fused_add_rms_norm_ref(x, residual, weight, eps)
    return quantize_fp8_per_token_reference(y)


def _check(x, weight, residual) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],) or x.stride(1) != 1:
        raise ValueError(
            f"x must be [T, hidden] with a contiguous last dimension and weight [hidden]; got x "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(
            f"hidden {x.shape[1]} is past {MAX_HIDDEN}, the widest row one block holds: use "
            "rms_norm, then quantize_fp8_per_token"
        )
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must be {tuple(x.shape)} like x, got {tuple(residual.shape)}")

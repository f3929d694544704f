"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

Semantics are engine/layers/norm.py's RMSNorm (and transformers'): normalise in float32, cast back
to the input's dtype, and only then multiply by the weight:

    y = weight * (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype)

The product with the weight is done in float32 and rounded once to x's dtype, which is what
torch does for a float16/bfloat16 multiply (the product of two such numbers is exact in
float32), so the kernel matches the module up to the order of the float32 sum.

Gemma's norm (`unit_offset=True`, RMSNorm(unit_offset=True) in the layer) differs in two places:
the weight is stored around zero and multiplies as (1 + w), and the product is taken in
float32 before the only rounding:

    y = (x32 * rsqrt(mean(x32 ** 2) + eps) * (1 + float32(weight))).to(x.dtype)

One program normalises ROWS rows (one when compiled: kernels/interpreter.py); a whole row
(hidden up to 8192) sits in one block, masked where hidden is not a power of two (576 for
SmolLM2, 64 for the tiny test models).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.interpreter import rows_per_program
from kvbatch.kernels.specialize import step_varying


@step_varying(ints=("num_rows",))
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,  # read and updated (residual += x) when HAS_RESIDUAL
    weight_ptr,
    out_ptr,
    num_rows,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_out,
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,  # Gemma: times (1 + w) in float32, one rounding
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]  # [ROWS, 1]
    cols = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = (rows < num_rows) & (cols < hidden)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows * stride_r + cols, mask=mask, other=0.0)
        dtype = r.dtype
        # Rounded to the residual's dtype, as `residual += x` is.
        x = (r.to(tl.float32) + x.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + rows * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=1)[:, None] / hidden  # [ROWS, 1]
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0)
    if UNIT_OFFSET:
        y = (x32 * tl.rsqrt(mean_sq + eps) * (1.0 + w.to(tl.float32))).to(dtype)
    else:
        normed = (x32 * tl.rsqrt(mean_sq + eps)).to(dtype)
        y = (normed.to(tl.float32) * w.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [T, hidden], x's dtype; may be x itself
    unit_offset: bool = False,  # Gemma's (1 + w) norm
) -> torch.Tensor:  # [T, hidden], x's dtype
    """RMSNorm of each row of x, as kvbatch.engine.layers.norm.RMSNorm computes it (or
    with `unit_offset`, as RMSNorm(unit_offset=True) does)."""
    x = _rows(x, weight, "x")
    out = torch.empty_like(x) if out is None else _check_out(out, x)
    _launch(x, None, weight, out, eps, unit_offset)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, hidden]
    residual: torch.Tensor,  # [T, hidden], updated in place
    weight: torch.Tensor,  # [hidden]
    eps: float,
    *,
    unit_offset: bool = False,  # Gemma's (1 + w) norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x`, then RMSNorm of the sum: returns (rms_norm(residual), residual).

    One pass over the row instead of two: the sum is written back and normalised while it is
    still in registers."""
    x = _rows(x, weight, "x")
    residual = _rows(residual, weight, "residual")
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    out = torch.empty_like(residual)
    _launch(x, residual, weight, out, eps, unit_offset)
    return out, residual


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> torch.Tensor:
    """Plain-torch reference: kvbatch.engine.layers.norm.RMSNorm with the weight in x's dtype,
    or with `unit_offset` the layer's RMSNorm(unit_offset=True)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        y = (x32 * (1.0 + weight.float())).to(x.dtype)
    else:
        y = weight.to(x.dtype) * x32.to(x.dtype)
    if out is None:
        return y
    return out.copy_(y)


def fused_add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference: `residual += x; return rms_norm(residual), residual`."""
    residual += x
    return rms_norm_ref(residual, weight, eps, unit_offset=unit_offset), residual


def _launch(x, residual, weight, out, eps, unit_offset: bool) -> None:
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    rows = rows_per_program()
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        x,
        x if residual is None else residual,  # unused without HAS_RESIDUAL
        weight,
        out,
        num_rows,
        hidden,
        eps,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        HAS_RESIDUAL=residual is not None,
        UNIT_OFFSET=unit_offset,
        ROWS=rows,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )


def _rows(t: torch.Tensor, weight: torch.Tensor, name: str) -> torch.Tensor:
    """The kernel walks rows by their stride and columns with stride 1."""
    if t.dim() != 2 or weight.shape != (t.shape[1],):
        raise ValueError(
            f"{name} must be [T, hidden] with weight [hidden]; got {name} {tuple(t.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if t.stride(1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous (stride 1)")
    return t


def _check_out(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must be {tuple(x.shape)} {x.dtype} with a contiguous last dimension; "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    return out

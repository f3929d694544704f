"""The gate of a gated MLP, act(gate) * up: SiLU-and-mul (SwiGLU) and GELU(tanh)-and-mul (GeGLU).

Semantics are engine/layers/activation.py's SiluAndMul (`F.silu(gate) * up`) and
GeluTanhAndMul (`F.gelu(gate, approximate="tanh") * up`): the activation is computed
in float32 and rounded to the input's dtype, then the product is rounded once more, so float16
results match the eager ops. silu is g / (1 + exp(-g)); the tanh GELU is torch's
0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), its tanh from one exp of a non-positive
number (no overflow).

A 2-D grid (row blocks x column blocks) rather than one program per row: intermediate sizes
reach 28672, too wide for one block. A row block is one row when compiled, more under the
interpreter (kernels/interpreter.py). gate and up may be strided views (the halves of a fused
gate_up projection); `out` may be gate itself, each element being read before it is written
by the same program.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvbatch.kernels.interpreter import rows_per_program
from kvbatch.kernels.specialize import step_varying

_BLOCK = 1024
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a jit function reads only constexpr globals


@triton.jit
def _gelu_tanh(g):
    """torch's F.gelu(g, approximate="tanh") on float32 g."""
    inner = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
    e = tl.exp(-2.0 * tl.abs(inner))  # in (0, 1]
    tanh_abs = (1.0 - e) / (1.0 + e)
    tanh = tl.where(inner >= 0, tanh_abs, -tanh_abs)
    return 0.5 * g * (1.0 + tanh)


@step_varying(ints=("num_rows",))
def _act_and_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    num_rows,
    num_cols,
    stride_g_row,
    stride_g_col,
    stride_u_row,
    stride_u_col,
    stride_o_row,
    stride_o_col,
    GELU_TANH: tl.constexpr,  # GeGLU's tanh GELU, else SiLU
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]  # [ROWS, 1]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]  # [1, BLOCK]
    mask = (row < num_rows) & (cols < num_cols)
    gate = tl.load(gate_ptr + row * stride_g_row + cols * stride_g_col, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_u_row + cols * stride_u_col, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    if GELU_TANH:
        act = _gelu_tanh(g).to(dtype)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o_row + cols * stride_o_col, y, mask=mask)


def silu_and_mul(
    gate: torch.Tensor,  # [T, F]
    up: torch.Tensor,  # [T, F]
    *,
    out: torch.Tensor | None = None,  # [T, F], gate's dtype; may be gate itself
) -> torch.Tensor:  # [T, F]
    """silu(gate) * up, elementwise."""
    return _act_and_mul(gate, up, out, gelu_tanh=False)


def gelu_tanh_and_mul(
    gate: torch.Tensor,  # [T, F]
    up: torch.Tensor,  # [T, F]
    *,
    out: torch.Tensor | None = None,  # [T, F], gate's dtype; may be gate itself
) -> torch.Tensor:  # [T, F]
    """gelu_tanh(gate) * up, elementwise (Gemma's GeGLU)."""
    return _act_and_mul(gate, up, out, gelu_tanh=True)


def _act_and_mul(gate, up, out, *, gelu_tanh: bool) -> torch.Tensor:
    _check_shapes(gate, up, out)
    out = torch.empty_like(gate) if out is None else out
    num_rows, num_cols = gate.shape
    if num_rows == 0 or num_cols == 0:
        return out
    rows = rows_per_program()
    _act_and_mul_kernel[(triton.cdiv(num_rows, rows), triton.cdiv(num_cols, _BLOCK))](
        gate,
        up,
        out,
        num_rows,
        num_cols,
        *gate.stride(),
        *up.stride(),
        *out.stride(),
        GELU_TANH=gelu_tanh,
        ROWS=rows,
        BLOCK=_BLOCK,
    )
    return out


def silu_and_mul_ref(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch reference: F.silu(gate) * up."""
    _check_shapes(gate, up, out)
    return torch.mul(F.silu(gate), up, out=out) if out is not None else F.silu(gate) * up


def gelu_tanh_and_mul_ref(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch reference: F.gelu(gate, approximate="tanh") * up."""
    _check_shapes(gate, up, out)
    act = F.gelu(gate, approximate="tanh")
    return torch.mul(act, up, out=out) if out is not None else act * up


def _check_shapes(gate, up, out) -> None:
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"gate and up must be [T, F] of one dtype; got gate {tuple(gate.shape)} "
            f"{gate.dtype}, up {tuple(up.shape)} {up.dtype}"
        )
    if out is not None and (out.shape != gate.shape or out.dtype != gate.dtype):
        raise ValueError(
            f"out must be {tuple(gate.shape)} {gate.dtype}; got {tuple(out.shape)} {out.dtype}"
        )

"""FP8 W8A8: per-token activation quantization and the scaled FP8 GEMM.

E4M3 (`torch.float8_e4m3fn`) holds values up to 448 with 3 mantissa bits and no inf. A tensor
is stored as fp8 values times a float32 scale; per token (a row of activations, computed at
run time) or per tensor (static, from the checkpoint) for activations, per output channel or
per tensor for weights:

    x ~= x_fp8 * scale,   scale = max(absmax(row) / 448, MIN_SCALE)

The GEMM is torch._scaled_mm (cuBLASLt) where it serves: a GPU with FP8 tensor cores
(sm_89+), K and N multiples of 16, and either both scales per tensor or (sm_90+) both per row
with a bfloat16 output (cuBLASLt's row-wise mode). Other shapes on those GPUs, and the CPU
interpreter, run the Triton kernel of kernels/scaled_mm.py. Older GPUs (Ampere) have no FP8
in Triton at all: there the operands are widened to float32 and multiplied in torch, and the
activations are quantized in torch: correct, with none of FP8's speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.fp8_cast import to_e4m3
from kvbatch.kernels.interpreter import interpreting, rows_per_program
from kvbatch.kernels.scaled_mm import (
    check_scaled_mm_inputs,
    launch_scaled_mm,
    scaled_mm_reference,
)
from kvbatch.kernels.specialize import step_varying

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# A floor under the scale, so that an all-zero row quantizes to zeros with a finite scale: the
# smallest normal float32, as compressed-tensors (whose checkpoints these layers run) and the
# engine's torch path (engine/quant/qdq.py) floor it. A higher floor (vLLM's 1 / (448 * 512))
# would quantize rows of magnitude below ~0.002 differently from the reference.
MIN_SCALE = float(torch.finfo(torch.float32).tiny)


@step_varying(ints=("num_rows",))
def _quantize_fp8_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] fp8
    scale_ptr,  # [M] float32: written (dynamic) or read at [0] (STATIC)
    num_rows,
    K,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    STATIC: tl.constexpr,
    ROUND_FIRST: tl.constexpr,  # under the interpreter (kernels/fp8_cast.py)
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < num_rows
    if STATIC:
        scale = tl.zeros([ROWS], tl.float32) + tl.load(scale_ptr)
    else:
        amax = tl.zeros([ROWS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_mask[:, None] & (cols < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask)
            amax = tl.maximum(amax, tl.max(tl.where(mask, tl.abs(x.to(tl.float32)), 0.0), 1))
        scale = tl.maximum(amax / 448.0, 1.1754943508222875e-38)  # MIN_SCALE: float32 tiny
        tl.store(scale_ptr + rows, scale, mask=row_mask)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask)
        q = tl.clamp(x.to(tl.float32) / scale[:, None], -448.0, 448.0)
        tl.store(
            q_ptr + rows[:, None] * stride_qm + cols[None, :] * stride_qk,
            to_e4m3(q, q_ptr.dtype.element_ty, ROUND_FIRST),
            mask=mask,
        )


def _quantize(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if x.is_cuda and not has_fp8_tensor_cores(x):  # no FP8 stores in Triton before sm_89
        if scale is None:
            return quantize_fp8_per_token_reference(x)
        return quantize_fp8_static_reference(x, scale.reshape(1, 1)), scale
    num_rows, K = x.shape
    q = torch.empty(num_rows, K, dtype=FP8_DTYPE, device=x.device)
    static = scale is not None
    if not static:
        scale = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0 or K == 0:
        return q, (scale if static else scale.fill_(MIN_SCALE))
    rows = rows_per_program()
    _quantize_fp8_kernel[(triton.cdiv(num_rows, rows),)](
        x, q, scale, num_rows, K, *x.stride(), *q.stride(),
        STATIC=static, ROUND_FIRST=interpreting(), ROWS=rows, BLOCK_K=min(1024, triton.next_power_of_2(K)),
    )  # fmt: skip
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: (x_fp8 [M, K], scale [M, 1] float32)."""
    return _quantize(x, None)


def quantize_fp8_per_token_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same arithmetic: float32 absmax / 448, floored at MIN_SCALE; x / scale
    clamped to +-448 and rounded to nearest E4M3."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    amax = x.float().abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(len(x), 1)
    scale = torch.clamp(amax.float() / FP8_MAX, min=MIN_SCALE)
    return quantize_fp8_static_reference(x, scale), scale


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor quantization with a checkpoint's input_scale [1, 1]: x_fp8 [M, K]."""
    _check_static_scale(scale)
    return _quantize(x, scale.reshape(1))[0]


def quantize_fp8_static_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Plain torch: (x / scale) clamped to +-448, rounded to nearest E4M3."""
    return torch.clamp(x.float() / scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check_static_scale(scale: torch.Tensor) -> None:
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(
            f"a static scale must be one float32 value, got {scale.dtype} {tuple(scale.shape)}"
        )


def fp8_scaled_mm(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, 1] or [1, 1] float32
    b: torch.Tensor,  # [N, K] float8_e4m3fn (a Linear's weight)
    b_scale: torch.Tensor,  # [N, 1] or [1, 1] float32
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] out_dtype
    """(a * a_scale) @ (b * b_scale).T + bias, accumulated in float32."""
    check_scaled_mm_inputs(a, a_scale, b, b_scale, bias, FP8_DTYPE)
    if _cublas_serves(a, a_scale, b, b_scale, out_dtype):
        return _cublas_scaled_mm(a, a_scale, b, b_scale, out_dtype, bias)
    if a.is_cuda and not has_fp8_tensor_cores(a):
        return _widened_mm(a, a_scale, b, b_scale, out_dtype, bias)
    return launch_scaled_mm(a, a_scale, b, b_scale, out_dtype, bias)


def fp8_scaled_mm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: exact products of the fp8 values, then the scales and bias in float32."""
    check_scaled_mm_inputs(a, a_scale, b, b_scale, bias, FP8_DTYPE)
    return scaled_mm_reference(a.float(), a_scale, b.float(), b_scale, out_dtype, bias)


def has_fp8_tensor_cores(t: torch.Tensor) -> bool:
    """An sm_89+ GPU (Ada, Hopper, Blackwell)."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 9)


def _cublas_serves(a, a_scale, b, b_scale, out_dtype) -> bool:
    """torch._scaled_mm's constraints: FP8 tensor cores, K and N multiples of 16, and scales
    both per tensor, or both per row (a per-tensor one is broadcast), which cuBLASLt does only
    on sm_90+ and with a bfloat16 output."""
    if not has_fp8_tensor_cores(a) or a.shape[1] % 16 or b.shape[0] % 16:
        return False
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        return True
    return out_dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (9, 0)


def _widened_mm(a, a_scale, b, b_scale, out_dtype, bias) -> torch.Tensor:
    """GPUs without FP8 in Triton: float32 operands (float16 would overflow: 448 * 448 alone
    is past its range), scales and bias applied as the kernel does."""
    acc = a.float() @ b.float().T
    out = acc * a_scale * b_scale.reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)


def _cublas_scaled_mm(a, a_scale, b, b_scale, out_dtype, bias) -> torch.Tensor:
    M, N = a.shape[0], b.shape[0]
    if a_scale.numel() == 1 and b_scale.numel() == 1:
        scale_a, scale_b = a_scale.reshape(()), b_scale.reshape(())
    else:  # row-wise: [M, 1] and [1, N], contiguous
        scale_a = a_scale.expand(M, 1).contiguous()
        scale_b = b_scale.reshape(1, -1).expand(1, N).contiguous()
    out = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out if bias is None else out.add_(bias)

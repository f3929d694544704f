"""The GEMM of W8A8 schemes: a low-precision a @ b.T, rescaled per row of a and per row of b.

    out[m, n] = (sum_k a[m, k] * b[n, k]) * a_scale[m] * b_scale[n] + bias[n]

a [M, K] and b [N, K] are both FP8 (float32 accumulation) or both INT8 (exact int32
accumulation); a_scale is [M, 1] (per token) or [1, 1] (per tensor), b_scale [N, 1] (per
output channel) or [1, 1]. The scales and the bias are applied once to the accumulator, in
float32, and the result is rounded once to out_dtype. kernels/fp8_gemm.py and
kernels/int8_gemm.py hold the public functions and their references; this file is the one
kernel both launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.specialize import step_varying


@step_varying(ints=("M", "stride_as"))  # stride_as: 0 for one row or a tensor scale, else 1
def _scaled_mm_kernel(
    a_ptr,  # [M, K] fp8 or int8
    b_ptr,  # [N, K]
    a_scale_ptr,  # [M] or [1] float32 (stride 0 when per tensor)
    b_scale_ptr,  # [N] or [1]
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_as,
    stride_bs,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    INTEGER: tl.constexpr,  # int8 inputs: int32 accumulator
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if INTEGER:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: b transposed by its strides
        acc += tl.dot(a, b)
    a_scale = tl.load(a_scale_ptr + offs_m * stride_as, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n * stride_bs, mask=n_mask, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def launch_scaled_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Run the kernel on checked inputs (the public functions check them)."""
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    a_scale, b_scale = a_scale.reshape(-1), b_scale.reshape(-1)
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n = 64
    block_k = 64 if K >= 64 else max(32, triton.next_power_of_2(K))
    _scaled_mm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        a, b, a_scale, b_scale, bias if bias is not None else b_scale, out,
        M, N, K,
        *a.stride(), *b.stride(),
        a_scale.stride(0) if a_scale.numel() > 1 else 0,
        b_scale.stride(0) if b_scale.numel() > 1 else 0,
        *out.stride(),
        HAS_BIAS=bias is not None, INTEGER=a.dtype == torch.int8,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def check_scaled_mm_inputs(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> None:
    """Shapes and dtypes of a W8A8 GEMM's operands, with errors that name the expected ones."""
    name = str(dtype).removeprefix("torch.")
    if a.dtype != dtype or b.dtype != dtype or a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"a [M, K] and b [N, K] must both be 2-D {name}; got a {a.dtype} {tuple(a.shape)}, "
            f"b {b.dtype} {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} must share K (b is [N, K])")
    M, N = a.shape[0], b.shape[0]
    for scale, rows, what in ((a_scale, M, "a_scale"), (b_scale, N, "b_scale")):
        if scale.dtype != torch.float32 or scale.shape not in ((rows, 1), (1, 1)):
            raise ValueError(
                f"{what} must be float32 [{rows}, 1] (per row) or [1, 1] (per tensor); got "
                f"{scale.dtype} {tuple(scale.shape)}"
            )
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")


def scaled_mm_reference(
    a_float: torch.Tensor,
    a_scale: torch.Tensor,
    b_float: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The epilogue in plain torch on exact products (float64: int8 sums and fp8 products are
    exact there), scales and bias in float32 as the kernel applies them."""
    acc = (a_float.double() @ b_float.double().T).float()
    out = acc * a_scale.float() * b_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)

"""Block-scaled FP8 W8A8 (DeepSeek-V3's scheme, Qwen3-*-FP8's, compressed-tensors' FP8_BLOCK):
per-token-group activation quantization and the block-scaled FP8 GEMM.

The weight b [N, K] is E4M3 with one float32 scale per [block_n, block_k] tile, b_scale
[ceil(N / block_n), ceil(K / block_k)]; the activations a [M, K] are quantized on the fly with
one scale per token and group of block_k values along K, a_scale [M, ceil(K / block_k)]
(absmax / 448). Within one K block every product then shares one a scale per row and one b
scale per column tile, so the GEMM accumulates each K block's FP8 dot in float32 and scales it
before adding it up:

    out[m, n] = sum_j a_scale[m, j] * b_scale[n // block_n, j] * (a_j[m] . b_j[n]) + bias[n]

where a_j, b_j are the K block j of a's row and b's row (the last block may be partial). The
kernel tiles K by BLOCK_K, a power of two (32 to 128) dividing block_k, and reads the scales of
the block each tile lies in. Older GPUs (no FP8 in Triton) and the references compute the same
sums in plain torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.fp8_cast import to_e4m3
from kvbatch.kernels.fp8_gemm import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    has_fp8_tensor_cores,
    quantize_fp8_static_reference,
)
from kvbatch.kernels.interpreter import interpreting, rows_per_program
from kvbatch.kernels.specialize import step_varying


@step_varying(ints=("num_rows", "stride_sm"))  # stride_sm: the layer's group count
def _quantize_groups_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] fp8
    scale_ptr,  # [M, G] float32
    num_rows,
    K,
    group_size,
    stride_xm,
    stride_xk,
    stride_qm,
    stride_qk,
    stride_sm,
    stride_sg,
    ROUND_FIRST: tl.constexpr,  # under the interpreter (kernels/fp8_cast.py)
    ROWS: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two >= group_size
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * group_size + tl.arange(0, BLOCK_G)
    mask = (rows < num_rows)[:, None] & ((cols < K) & (cols < (group + 1) * group_size))[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask)
    x = x.to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
    scale = tl.maximum(amax / 448.0, 1.1754943508222875e-38)  # MIN_SCALE: float32 tiny
    tl.store(scale_ptr + rows * stride_sm + group * stride_sg, scale, mask=rows < num_rows)
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(
        q_ptr + rows[:, None] * stride_qm + cols[None, :] * stride_qk,
        to_e4m3(q, q_ptr.dtype.element_ty, ROUND_FIRST),
        mask=mask,
    )


def quantize_fp8_per_token_group(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization per token and group of `group_size` along K:
    (x_fp8 [M, K], scale [M, ceil(K / group_size)] float32)."""
    _check_rows(x, group_size)
    if x.is_cuda and not has_fp8_tensor_cores(x):  # no FP8 stores in Triton before sm_89
        return quantize_fp8_per_token_group_reference(x, group_size)
    num_rows, k = x.shape
    groups = triton.cdiv(k, group_size)
    q = torch.empty(num_rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)
    if num_rows == 0 or k == 0:
        return q, scale
    rows = rows_per_program()
    _quantize_groups_kernel[(triton.cdiv(num_rows, rows), groups)](
        x, q, scale, num_rows, k, group_size, *x.stride(), *q.stride(), *scale.stride(),
        ROUND_FIRST=interpreting(), ROWS=rows, BLOCK_G=triton.next_power_of_2(group_size),
    )  # fmt: skip
    return q, scale


def quantize_fp8_per_token_group_reference(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same arithmetic: float32 group absmax / 448 floored at MIN_SCALE; x / scale
    clamped to +-448 and rounded to nearest E4M3."""
    _check_rows(x, group_size)
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group_size))
    grouped = padded.reshape(m, -1, group_size)
    scale = torch.clamp(grouped.abs().amax(-1) / FP8_MAX, min=MIN_SCALE)  # [M, G]
    q = quantize_fp8_static_reference(grouped, scale[..., None]).reshape(m, -1)[:, :k]
    return q, scale


@step_varying(ints=("M",))
def _block_scaled_mm_kernel(
    a_ptr,  # [M, K] fp8
    b_ptr,  # [N, K] fp8
    a_scale_ptr,  # [M, KB] float32
    b_scale_ptr,  # [NB, KB] float32
    bias_ptr,  # [N] (read only when HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    block_n,
    block_k,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_asm,
    stride_asg,
    stride_bsn,
    stride_bsg,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides block_k: a tile lies in one scale block
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    b_scale_rows = b_scale_ptr + (offs_n // block_n) * stride_bsn  # [BLOCK_N]
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
        kb = k0 // block_k
        a_s = tl.load(a_scale_ptr + offs_m * stride_asm + kb * stride_asg, mask=m_mask, other=0.0)
        b_s = tl.load(b_scale_rows + kb * stride_bsg, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def fp8_block_scaled_mm(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, ceil(K / block_k)] float32
    b: torch.Tensor,  # [N, K] float8_e4m3fn (a Linear's weight)
    b_scale: torch.Tensor,  # [ceil(N / block_n), ceil(K / block_k)] float32
    block: tuple[int, int],  # (block_n, block_k)
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] out_dtype
    """sum over K blocks j of (a_j @ b_j.T) * a_scale[:, j] * b_scale[n // block_n, j], + bias;
    each block's dot accumulated in float32."""
    check_block_mm_inputs(a, a_scale, b, b_scale, block, bias)
    if a.is_cuda and not has_fp8_tensor_cores(a):
        return fp8_block_scaled_mm_reference(a, a_scale, b, b_scale, block, out_dtype, bias)
    m, k = a.shape
    n = b.shape[0]
    block_k = kernel_block_k(block[1])
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64
    _block_scaled_mm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        a, b, a_scale, b_scale, bias if bias is not None else b_scale, out,
        m, n, k, block[0], block[1],
        *a.stride(), *b.stride(), *a_scale.stride(), *b_scale.stride(), *out.stride(),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def fp8_block_scaled_mm_reference(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: each K block's exact FP8 products (float64), scaled in float32, summed."""
    check_block_mm_inputs(a, a_scale, b, b_scale, block, bias)
    n, k = b.shape
    block_n, block_k = block
    b_scale_rows = b_scale.repeat_interleave(block_n, 0)[:n]  # [N, KB]
    out = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    for j, k0 in enumerate(range(0, k, block_k)):
        cols = slice(k0, k0 + block_k)
        dot = (a[:, cols].double() @ b[:, cols].double().T).float()
        out += dot * a_scale[:, j : j + 1] * b_scale_rows[None, :, j]
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def kernel_serves_block_k(block_k: int) -> bool:
    """Whether the kernels tile weight blocks of block_k columns (a multiple of 32: FP8 dots
    take K tiles of 32 or more); callers run the reference path for other blocks."""
    return block_k > 0 and (block_k & -block_k) >= 32


def kernel_block_k(block_k: int) -> int:
    """The kernel's K tile for weight blocks of block_k columns: the largest power of two up to
    128 dividing it, at least 32 (FP8 dots take K tiles of 32 or more)."""
    tile = min(128, block_k & -block_k)
    if not kernel_serves_block_k(block_k):
        raise ValueError(
            f"the block FP8 kernel needs weight blocks of a multiple of 32 columns, got "
            f"block_k = {block_k}"
        )
    return tile


def check_block_mm_inputs(a, a_scale, b, b_scale, block, bias) -> None:
    """Shapes and dtypes of a block-scaled GEMM's operands, with errors naming what is wanted."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE or a.dim() != 2 or b.dim() != 2:
        raise ValueError(
            f"a [M, K] and b [N, K] must both be 2-D float8_e4m3fn; got a {a.dtype} "
            f"{tuple(a.shape)}, b {b.dtype} {tuple(b.shape)}"
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} must share K (b is [N, K])")
    (m, k), n = a.shape, b.shape[0]
    block_n, block_k = block
    kb = -(-k // block_k)
    for scale, shape, what in (
        (a_scale, (m, kb), "a_scale"),
        (b_scale, (-(-n // block_n), kb), "b_scale"),
    ):
        if scale.dtype != torch.float32 or tuple(scale.shape) != shape:
            raise ValueError(
                f"{what} must be float32 {list(shape)} for blocks of {list(block)}; got "
                f"{scale.dtype} {tuple(scale.shape)}"
            )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")


def _check_rows(x: torch.Tensor, group_size: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")

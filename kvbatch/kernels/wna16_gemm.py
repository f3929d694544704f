"""Weight-only quantized GEMM (W4A16, W8A16): out = x @ dequantize(qweight), dequantized in
registers, tile by tile, so the weights cross memory at 4 or 8 bits per value.

Every weight-only format (GPTQ, AWQ, compressed-tensors pack-quantized) is converted at load
into one canonical layout (engine/quant does the conversion), GPTQ's:

    qweight  int32 [ceil(K / P), N]   P = 32 // bits values of column n packed along K;
                                      value j of a word sits in bits [bits*j, bits*(j+1))
    scales   [G, N]  zeros [G, N]     activation dtype, G groups along K
    g_idx    int32 [K] or None        k's group (act-order), None: k // group_size

    w[k, n] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]

    word row r of column n:  | q[rP+P-1] | ... | q[rP+1] | q[rP] |   (bit 31 ... bit 0)

Symmetric formats store zeros = 2**(bits - 1). K need not be a multiple of P: the last word's
unused values are masked (the contract's shape is K // P words when it is).

Act-order (GPTQ `desc_act`) quantizes input rows in order of importance, so neighbouring k
belong to different groups: the kernel gathers each row's scale and zero through g_idx. With
no g_idx and a group that spans whole K tiles, one scale row per tile is loaded instead.

The dequantized tile is rounded to x's dtype before the dot (what a dequantize-then-GEMM would
compute) and products accumulate in float32.

Split-K: at batch 1 to 16 the output is a few tiles wide (N / BLOCK_N programs: 64 for N 4096,
half the H200's SMs), so each program would stream its whole column of weights alone. The K
range is then cut into `split_k` slices, one program per (tile, slice) writes a float32
partial, and the partials are summed in slice order (a fixed order: the same sums whatever
else the GPU runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.decode_attention import num_sms
from kvbatch.kernels.specialize import step_varying

SUPPORTED_BITS = (4, 8)
MAX_SPLIT_K = 16
MIN_K_PER_SPLIT = 512  # a slice must amortise its partial's write


@step_varying(ints=("M",))
def _wna16_gemm_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [ceil(K / P), N] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    g_idx_ptr,  # [K] int32 (read only when HAS_G_IDX)
    out_ptr,  # [M, N], or float32 partials [SPLIT_K, M, N]
    M,
    N,
    K,
    k_per_split,  # K rows per slice, a multiple of BLOCK_K (K when SPLIT_K is 1)
    group_size,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_os,
    stride_om,
    stride_on,
    BITS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    GROUP_PER_TILE: tl.constexpr,  # no g_idx and group_size % BLOCK_K == 0: one group a tile
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_dtype = x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        wk_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(
            qweight_ptr + (offs_k // PACK)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
            mask=wk_mask,
            other=0,
        )  # [BLOCK_K, BLOCK_N] int32, each word read once per value it holds (cached)
        shift = ((offs_k % PACK) * BITS)[:, None]
        q = ((words >> shift) & ((1 << BITS) - 1)).to(tl.float32)
        if GROUP_PER_TILE:
            g = k0 // group_size
            s = tl.load(scales_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
            z = tl.load(zeros_ptr + g * stride_zg + offs_n * stride_zn, mask=n_mask, other=0.0)
            s = s.to(tl.float32)[None, :]
            z = z.to(tl.float32)[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)
            else:
                g = offs_k // group_size
            g = g[:, None]
            s = tl.load(scales_ptr + g * stride_sg + offs_n[None, :] * stride_sn, mask=wk_mask)
            z = tl.load(zeros_ptr + g * stride_zg + offs_n[None, :] * stride_zn, mask=wk_mask)
            s = s.to(tl.float32)
            z = z.to(tl.float32)
        # masked rows have q = 0 but arbitrary s, z: zero them so 0 * x never meets inf or nan
        w = tl.where(wk_mask, (q - z) * s, 0.0).to(x_dtype)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision=PRECISION)

    tl.store(
        out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def wna16_gemm(
    x: torch.Tensor,  # [M, K] float16 / bfloat16 / float32
    qweight: torch.Tensor,  # [ceil(K / (32 // bits)), N] int32
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N]
    g_idx: torch.Tensor | None,  # [K] int32, or None: group k // group_size
    group_size: int,
    bits: int,
    *,
    split_k: int | None = None,  # K slices (None: chosen from the shapes)
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ w with w dequantized from the canonical packed layout (see the module docstring)."""
    M, K, N = _check_inputs(x, qweight, scales, zeros, g_idx, group_size, bits)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_n = 64
    block_k = 64 if K >= 64 else max(16, triton.next_power_of_2(K))
    group_per_tile = g_idx is None and group_size % block_k == 0
    g_idx_arg = g_idx.contiguous() if g_idx is not None else qweight  # never read without HAS_G_IDX
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if split_k is None:
        split_k = choose_split_k(tiles, K, x.device)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per_split)  # no empty slice
    dest = out
    if split_k > 1:
        dest = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)
    dest_strides = dest.stride() if split_k > 1 else (0, *out.stride())
    _wna16_gemm_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)](
        x, qweight, scales, zeros, g_idx_arg, dest,
        M, N, K, k_per_split, group_size,
        *x.stride(), *qweight.stride(), *scales.stride(), *zeros.stride(), *dest_strides,
        BITS=bits, HAS_G_IDX=g_idx is not None, GROUP_PER_TILE=group_per_tile,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=4, num_stages=3,
    )  # fmt: skip
    if split_k > 1:
        out.copy_(dest.sum(dim=0))  # slices in order, float32, rounded once
    return out


def choose_split_k(tiles: int, K: int, device: torch.device) -> int:
    """K slices so that about two waves of programs fill the GPU, each slice at least
    MIN_K_PER_SPLIT rows of K (1 when the output tiles alone fill it)."""
    wanted = 2 * num_sms(device) // max(1, tiles)
    useful = max(1, K // MIN_K_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLIT_K))


def unpack_qweight(qweight: torch.Tensor, bits: int, K: int) -> torch.Tensor:
    """The unsigned integers [K, N] (int32) packed in the canonical qweight."""
    pack = 32 // bits
    shifts = torch.arange(pack, device=qweight.device, dtype=torch.int32) * bits
    values = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # [rows, P, N]
    return values.reshape(-1, qweight.shape[1])[:K]


def pack_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integers q [K, N] in [0, 2**bits) into the canonical int32 qweight
    [ceil(K / P), N] (the inverse of unpack_qweight; the last word is zero-padded)."""
    pack = 32 // bits
    K, N = q.shape
    rows = -(-K // pack)
    padded = torch.zeros(rows * pack, N, dtype=torch.int64, device=q.device)
    padded[:K] = q.to(torch.int64)
    shifts = torch.arange(pack, device=q.device, dtype=torch.int64) * bits
    words = (padded.view(rows, pack, N) << shifts[None, :, None]).sum(dim=1)  # < 2**32
    return (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)  # as signed


def dequantize_wna16(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    bits: int,
    K: int,
) -> torch.Tensor:  # [K, N] float32
    """The float weight w[k, n] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]."""
    q = unpack_qweight(qweight, bits, K).float()
    g = g_idx.long() if g_idx is not None else torch.arange(K, device=q.device) // group_size
    return (q - zeros.float()[g]) * scales.float()[g]


def wna16_gemm_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """Plain torch: dequantize to x's dtype, then x @ w with float32 accumulation."""
    M, K, N = _check_inputs(x, qweight, scales, zeros, g_idx, group_size, bits)
    w = dequantize_wna16(qweight, scales, zeros, g_idx, group_size, bits, K).to(x.dtype)
    return (x.float() @ w.float()).to(x.dtype)


def _check_inputs(x, qweight, scales, zeros, g_idx, group_size, bits) -> tuple[int, int, int]:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(
            f"qweight must be int32 [K / {32 // bits}, N], got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    M, K = x.shape
    N = qweight.shape[1]
    pack = 32 // bits
    if qweight.shape[0] != -(-K // pack):
        raise ValueError(
            f"qweight has {qweight.shape[0]} rows of {pack} packed {bits}-bit values; x's "
            f"K = {K} needs {-(-K // pack)}"
        )
    if group_size <= 0:
        raise ValueError(f"group_size must be > 0, got {group_size}")
    groups = scales.shape[0] if scales.dim() == 2 else -1
    if scales.dim() != 2 or scales.shape != zeros.shape or scales.shape[1] != N:
        raise ValueError(
            f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} must both be [G, {N}]"
        )
    if g_idx is None:
        if groups * group_size < K:
            raise ValueError(
                f"{groups} groups of {group_size} cover {groups * group_size} of K = {K} rows: "
                "pass the checkpoint's group size (or g_idx)"
            )
    elif g_idx.shape != (K,) or g_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"g_idx must be int32 [{K}], got {g_idx.dtype} {tuple(g_idx.shape)}")
    return M, K, N

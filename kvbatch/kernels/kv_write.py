"""Scatter a step's new K/V rows into the paged KV cache.

One layer's cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V). Token
t goes to slot `slot_mapping[t] = block * block_size + offset`:

    kv_cache[0, block, offset] = k[t]      # [num_kv_heads, head_dim]
    kv_cache[1, block, offset] = v[t]

An FP8 cache (`torch.float8_e4m3fn`) stores value / scale, one scale for K and one for V per
layer, clamped to E4M3's +-448 and rounded to nearest even; attention multiplies them back.

A negative slot means "skip this row": CUDA-graph batches are padded to a captured size, and
the padding rows must not write anywhere. The kernel masks them out on the device, so the
launch never reads the slots back to the host and can be captured in a graph.

One program writes ROWS tokens (one when compiled: kernels/interpreter.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.fp8_cast import to_e4m3
from kvbatch.kernels.interpreter import interpreting, rows_per_program
from kvbatch.kernels.kv_quant import is_fp8, quantize_kv, scatter_rows
from kvbatch.kernels.specialize import step_varying


@step_varying(ints=("num_tokens",), pointers=("slot_ptr",))
def _write_kv_kernel(
    cache_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    num_tokens,
    num_kv_heads,
    head_dim,
    block_size,
    k_scale,  # FP8: stored = k / k_scale (unused otherwise)
    v_scale,
    stride_c_kv,  # kv_cache strides: K/V, block, offset, head, dim
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_c_dim,
    stride_k_t,
    stride_k_head,
    stride_k_dim,
    stride_v_t,
    stride_v_head,
    stride_v_dim,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the cache is E4M3: quantize with the scales
    ROUND_FIRST: tl.constexpr,  # under the interpreter (kernels/fp8_cast.py)
):
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    slot = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    t = tokens[:, None, None]  # [ROWS, 1, 1]
    slot = slot[:, None, None]
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_H)[None, :, None]
    dims = tl.arange(0, BLOCK_D)[None, None, :]
    # slot < 0 masks the whole row (a padding row, or past the last token): nothing is read,
    # nothing is written.
    mask = (slot >= 0) & (heads < num_kv_heads) & (dims < head_dim)

    dst = cache_ptr + block * stride_c_block + offset * stride_c_off
    dst += heads * stride_c_head + dims * stride_c_dim
    k = tl.load(k_ptr + t * stride_k_t + heads * stride_k_head + dims * stride_k_dim, mask=mask)
    v = tl.load(v_ptr + t * stride_v_t + heads * stride_v_head + dims * stride_v_dim, mask=mask)
    if FP8:
        k = to_e4m3(
            tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0), cache_ptr.dtype.element_ty,
            ROUND_FIRST,
        )  # fmt: skip
        v = to_e4m3(
            tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0), cache_ptr.dtype.element_ty,
            ROUND_FIRST,
        )  # fmt: skip
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int32/int64; negative: skip the row
    *,
    k_scale: float = 1.0,  # FP8 caches: stored = k / k_scale
    v_scale: float = 1.0,
) -> None:
    """Write each token's K and V into its cache slot; rows with a negative slot are skipped.

    k and v may be strided views (slices of a fused qkv projection). An FP8 cache gets
    k / k_scale and v / v_scale in E4M3; other caches ignore the scales."""
    _check_shapes(kv_cache, k, v, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _, _, block_size, _, _ = kv_cache.shape
    slot_mapping = slot_mapping.contiguous()
    rows = rows_per_program()
    _write_kv_kernel[(triton.cdiv(num_tokens, rows),)](
        kv_cache,
        k,
        v,
        slot_mapping,
        num_tokens,
        num_kv_heads,
        head_dim,
        block_size,
        k_scale,
        v_scale,
        *kv_cache.stride(),
        *k.stride(),
        *v.stride(),
        ROWS=rows,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=is_fp8(kv_cache),
        ROUND_FIRST=interpreting(),
    )


def write_kv_cache_ref(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch reference: the engine's index_copy_ write with negative slots dropped.

    The boolean filter reads the mask on the host: fine for a reference, not graph-capturable.
    """
    _check_shapes(kv_cache, k, v, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if is_fp8(kv_cache):
        k, v = quantize_kv(k, k_scale, kv_cache.dtype), quantize_kv(v, v_scale, kv_cache.dtype)
    scatter_rows(kv_cache, k[keep], v[keep], slots)


def _check_shapes(kv_cache, k, v, slot_mapping) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    if k.shape != v.shape or k.shape[1:] != kv_cache.shape[3:]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
            f"[T, {kv_cache.shape[3]}, {kv_cache.shape[4]}] to match the cache"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")

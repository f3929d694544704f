"""The FP8 KV cache's arithmetic in plain torch: what the KV write kernel stores and what the
attention kernels read back, for the references and the torch backend.

    stored = E4M3(clamp(x / scale, -448, 448))      x ~= stored * scale

No triton here: the torch attention backend imports this module on machines without it.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0


def is_fp8(kv_cache: torch.Tensor) -> bool:
    """Whether the cache stores E4M3 values with scales (kv_cache_dtype="fp8")."""
    return kv_cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype = FP8_KV_DTYPE) -> torch.Tensor:
    """x / scale in float32, clamped to E4M3's range and rounded to nearest (even)."""
    return torch.clamp(x.float() / scale, -E4M3_MAX, E4M3_MAX).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """stored * scale in `dtype`: the E4M3 values widen exactly, then the scale rounds once
    (nothing at all when the scale is 1)."""
    x = stored.to(dtype)
    return x if scale == 1.0 else x * scale


def round_trip_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as attention reads it back from an FP8 cache, in x's dtype."""
    return dequantize_kv(quantize_kv(x, scale), scale, x.dtype)


def scatter_rows(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots) -> None:
    """kv_cache[0/1] at `slots` (flat block * block_size + offset) = k / v, cast to the cache's
    dtype. FP8 rows are copied as bytes: the CPU has no index_copy_ for float8 dtypes."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if is_fp8(kv_cache):
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    if kv_cache.stride(1) != kv_cache[0, 0].numel():  # a slot shared with wider layers
        block_size = kv_cache.shape[2]  # (engine/kv/layer_tensors.py): blocks are strided
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[0].index_put_((blocks, offsets), k)
        kv_cache[1].index_put_((blocks, offsets), v)
        return
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)

"""One layer's paged KV cache as the torch backend reads it: blocks gathered in table order,
dequantized when the cache is FP8."""

from __future__ import annotations

import torch

from kvbatch.engine.attention.kv_scales import KVScales
from kvbatch.kernels.kv_quant import dequantize_kv, is_fp8


class KVView:
    """One layer's cache as attention reads it: gathered blocks in the queries' dtype,
    dequantized with `scales` when the cache is FP8 (a float cache is returned as it is)."""

    def __init__(self, kv_cache: torch.Tensor, scales: KVScales, dtype: torch.dtype) -> None:
        self.cache, self.scales, self.dtype = kv_cache, scales, dtype
        _, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.fp8 = is_fp8(kv_cache)

    def gather(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the listed blocks in order: [blocks * block_size, kv_heads, head_dim]
        each (a 2-D table gives its rows one after another)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        keys = gather_blocks(self.cache[0], block_ids).view(shape)
        values = gather_blocks(self.cache[1], block_ids).view(shape)
        if self.fp8:
            keys = dequantize_kv(keys, self.scales.k, self.dtype)
            values = dequantize_kv(values, self.scales.v, self.dtype)
        return keys, values

    def gather_heads_first(self, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of each row's table [B, blocks] as contiguous [kv_heads, B,
        blocks * block_size, head_dim]: the layout a batched matmul over (kv_heads, B) reads as
        it is. Made by an explicit copy after the gather, which on the CPU costs a third of the
        copy a matmul makes of a strided [B, kv_heads, S, d] view."""
        rows = tables.shape[0]
        keys, values = self.gather(tables)  # [B * S, kvh, d]
        shape = (rows, -1, self.num_kv_heads, self.head_dim)
        return (
            keys.view(shape).permute(2, 0, 1, 3).contiguous(),
            values.view(shape).permute(2, 0, 1, 3).contiguous(),
        )


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy the listed blocks out of one layer's K or V pool, in table order.

    index_select on a flat list of block ids is one contiguous gather; advanced indexing with
    a 2-D table is several times slower on the CPU.
    """
    return torch.index_select(cache, 0, block_ids.reshape(-1))

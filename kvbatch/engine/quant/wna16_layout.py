"""The one layout every 4/8-bit weight-only format is converted into at load.

    qweight  int32 [K // (32 // bits), N]   values packed along K; value j of a word sits in
                                            bits [bits*j, bits*(j+1)) (GPTQ's order), unsigned
    scales   [G, N]  activation dtype       G groups along K
    zeros    [G, N]  activation dtype       symmetric formats: 2 ** (bits - 1)
    g_idx    int32 [K] or None              the group of each input row (act-order);
                                            None: row k is in group k // group_size

    w[k, n] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]

The W4A16 GEMM kernel (kvbatch.kernels.wna16_gemm) reads exactly this; the CPU dequantizes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WNA16Weights:
    qweight: torch.Tensor  # int32 [K // pack, N]
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor  # [G, N]
    g_idx: torch.Tensor | None  # int32 [K]
    group_size: int  # rows per group (K for one group over all of K)
    bits: int

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * (32 // self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float weight [N, K] (nn.Linear's orientation) in the scales' dtype."""
        q = unpack_rows(self.qweight, self.bits)  # [K, N]
        groups = self.group_index(q.device)
        scales, zeros = self.scales[groups], self.zeros[groups]  # [K, N]
        return ((q.to(scales.dtype) - zeros) * scales).t().contiguous()

    def group_index(self, device: torch.device) -> torch.Tensor:
        """g(k) for every input row k: int64 [K]."""
        if self.g_idx is not None:
            return self.g_idx.to(device=device, dtype=torch.long)
        return torch.arange(self.in_features, device=device) // self.group_size


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [K, N] (K a multiple of 32 // bits) -> int32 [K // pack, N], value j of
    each word in bits [bits*j, bits*(j+1))."""
    pack = 32 // bits
    k, n = q.shape
    if k % pack:
        raise ValueError(f"{k} input rows cannot be packed {pack} to an int32")
    shifts = torch.arange(0, 32, bits, device=q.device, dtype=torch.int64)
    words = (q.to(torch.int64).reshape(k // pack, pack, n) << shifts[None, :, None]).sum(1)
    return _as_int32(words)


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K // pack, N] -> unsigned values int32 [K, N] (inverse of pack_rows)."""
    shifts = torch.arange(0, 32, bits, device=qweight.device, dtype=torch.int32)
    values = (qweight[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, qweight.shape[1])


def unpack_columns(packed: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """int32 [R, C // pack] packed along columns -> unsigned int32 [R, C]. `order[i]` is the
    column (within each word's block of 32 // bits) held by value i of the word; None keeps
    value i in column i."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    values = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C/p, p]
    if order is not None:
        inverse = [order.index(c) for c in range(len(order))]
        values = values[:, :, inverse]
    return values.reshape(packed.shape[0], -1)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 32 bits of int64 values as int32 (two's complement)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

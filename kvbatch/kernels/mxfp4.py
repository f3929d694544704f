"""MXFP4 (OCP microscaling FP4) weights as gpt-oss publishes its experts, and their dequantization.

A weight [N, K] is stored in groups of 32 values along K (the input dimension):

    blocks  uint8 [..., N, K / 32, 16]   two FP4 E2M1 values a byte, the LOW nibble first
    scales  uint8 [..., N, K / 32]       one E8M0 exponent per group: 2 ** (scale - 127)

    value(n, k) = FP4[nibble(n, k)] * 2 ** (scales[n, k // 32] - 127)

E2M1 codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 the same values negated (the sign is
the top bit). Every dequantized value is exact in bfloat16 and float32 (a 2-bit mantissa times
a power of two), so dequantizing in float32 and rounding to the model's dtype equals
transformers' integrations/mxfp4.py, which looks the codes up in the target dtype and applies
`ldexp` there.

Experts stay 4-bit in memory (`Mxfp4Experts`, 4.25 bits a value with the scales): the CPU
dequantizes one expert's weight at a time (`dequantize_expert`), the GPU's grouped GEMM
(kernels/fused_moe_mxfp4.py) dequantizes [BLOCK_K, BLOCK_N] tiles in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MXFP4_GROUP = 32  # values per E8M0 scale
MXFP4_BLOCK_BYTES = MXFP4_GROUP // 2  # 16 bytes hold one group
E8M0_BIAS = 127
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_E2M1_TABLE = FP4_E2M1_VALUES + tuple(-v for v in FP4_E2M1_VALUES)  # codes 0..15


def dequantize_mxfp4(
    blocks: torch.Tensor,  # uint8 [..., N, G, 16]
    scales: torch.Tensor,  # uint8 [..., N, G]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., N, G * 32] in dtype
    """The weight the blocks and scales encode, rows as stored (out features first)."""
    lut = torch.tensor(FP4_E2M1_TABLE, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., N, G, 32] low nibble first
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - E8M0_BIAS)
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round a float weight [..., N, K] (K a multiple of 32) to MXFP4: (blocks, scales).

    Each group's scale is the power of two that brings its largest magnitude to at most 6
    (the largest E2M1 value), then each value goes to the nearest E2M1 code (ties to the
    smaller magnitude). Used to write test and benchmark checkpoints; a weight that came out
    of `dequantize_mxfp4` quantizes back to the same values."""
    *lead, n, k = w.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the input dimension a multiple of 32; got {k}")
    groups = w.float().reshape(*lead, n, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS + 1)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_E2M1_VALUES, device=w.device)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # nearest, first on ties
    codes = codes + 8 * ((scaled < 0) & (codes > 0))
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


@dataclass(frozen=True)
class Mxfp4Experts:
    """Every expert's MXFP4 projection [N, K], stacked: the checkpoint's bytes as they are
    (rows may have been reordered at load, as gpt-oss's interleaved gate/up rows are)."""

    blocks: torch.Tensor  # uint8 [E, N, K / 32, 16]
    scales: torch.Tensor  # uint8 [E, N, K / 32]

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 4:
            raise ValueError(
                f"MXFP4 blocks must be uint8 [E, N, K / 32, 16], got {self.blocks.dtype} "
                f"{tuple(self.blocks.shape)}"
            )
        if self.blocks.shape[-1] != MXFP4_BLOCK_BYTES:
            raise ValueError(
                f"MXFP4 blocks hold 16 bytes (32 values) per group; got {self.blocks.shape[-1]}"
            )
        if self.scales.dtype != torch.uint8 or self.scales.shape != self.blocks.shape[:-1]:
            raise ValueError(
                f"MXFP4 scales must be uint8 {list(self.blocks.shape[:-1])} (one per group of "
                f"blocks), got {self.scales.dtype} {tuple(self.scales.shape)}"
            )

    @property
    def num_experts(self) -> int:
        return self.blocks.shape[0]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[1]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[2] * MXFP4_GROUP

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    def dequantize_expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's weight [N, K] in `dtype` (the others stay packed)."""
        return dequantize_mxfp4(self.blocks[e], self.scales[e], dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Every expert's weight [E, N, K] in `dtype`."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    def to(self, device: torch.device | str) -> Mxfp4Experts:
        return Mxfp4Experts(self.blocks.to(device), self.scales.to(device))

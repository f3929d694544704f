"""Rounding float32 to E4M3 (`torch.float8_e4m3fn`) inside a kernel, correctly under Triton's
interpreter too.

Compiled kernels convert with the GPU's own instruction (round to nearest even). Triton's CPU
interpreter (3.9) converts in numpy by truncating the mantissa and adding the first cut-off
bit to it, without carrying into the exponent: 126.9 becomes 64 instead of 128, and ties go
up instead of to even. `to_e4m3` therefore first rounds the value to E4M3's precision in
float32 when ROUND_FIRST is set (the callers pass `interpreting()`), so that the cast that
follows only drops zero bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3_precision(v):
    """v (float32, |v| <= 448) rounded to nearest even on E4M3's grid: 3 mantissa bits for
    normals (|v| >= 2**-6), steps of 2**-9 below."""
    bits = v.to(tl.int32, bitcast=True)
    # keep the sign, exponent and top 3 mantissa bits; round on bit 20 (carries into the
    # exponent when the mantissa overflows)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    # 1.5 * 2**23: float32 addition rounds the scaled value to an integer, ties to even
    subnormal = ((v * 512.0 + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def to_e4m3(v, dtype: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """v (float32, already clamped to +-448) cast to the E4M3 dtype `dtype`."""
    if ROUND_FIRST:
        v = round_to_e4m3_precision(v)
    return v.to(dtype)

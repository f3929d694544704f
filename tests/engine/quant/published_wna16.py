"""GPTQ and AWQ packing and dequantization as their libraries publish them, transcribed.

No maintained GPTQ or AWQ library installs on these CPU-only machines (GPTQModel, AutoGPTQ
and AutoAWQ build CUDA extensions), so the engine's unpacking is checked against the libraries'
own torch code on the same bytes:

- GPTQ: the torch path of AutoGPTQ's `QuantLinear.forward` (qlinear_cuda / qlinear_cuda_old,
  also GPTQModel's): shift each int32 right by `range(0, 32, bits)`, mask, zero points plus
  one for v1 checkpoints and masked again, `scales[g_idx] * (weight - zeros[g_idx])`; and its
  `pack`: `qweight[row] |= intweight[j] << (bits * (j - i))`, zero points likewise along N.
- AWQ: AutoAWQ's `awq/utils/packing_utils.py` (`unpack_awq`, `reverse_awq_order`,
  `dequantize_gemm`, AWQ_REVERSE_ORDER) and its `WQLinear_GEMM.from_linear` packer
  (order_map [0, 2, 4, 6, 1, 3, 5, 7]).
"""

from __future__ import annotations

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits: int, v1: bool) -> torch.Tensor:
    """AutoGPTQ's torch dequantization -> float weight [K, N]."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(
        torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)
    ).to(torch.int16 if bits == 8 else torch.int8)
    if v1:
        zeros = zeros + 1
    zeros = torch.bitwise_and(zeros, (2**bits) - 1)
    zeros = zeros.reshape(scales.shape)
    weight = torch.bitwise_right_shift(
        torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)
    ).to(torch.int16 if bits == 8 else torch.int8)
    weight = torch.bitwise_and(weight, (2**bits) - 1)
    weight = weight.reshape(-1, weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


def gptq_pack(intweight: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool):
    """AutoGPTQ's pack: intweight [K, N], zeros [G, N] (true zero points) -> (qweight,
    qzeros); v1 stores zero points minus one."""
    iw = intweight.to(torch.int64)
    qweight = torch.zeros(iw.shape[0] // 32 * bits, iw.shape[1], dtype=torch.int64)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= iw[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    z = zeros.to(torch.int64) - (1 if v1 else 0)
    z = z & ((1 << bits) - 1)  # numpy's uint32 view of -1 keeps the low bits
    qzeros = torch.zeros(z.shape[0], z.shape[1] // 32 * bits, dtype=torch.int64)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= z[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return _int32(qweight), _int32(qzeros)


def awq_dequantize(qweight, qzeros, scales, bits: int, group_size: int) -> torch.Tensor:
    """AutoAWQ's dequantize_gemm -> float weight [K, N]."""
    shifts = torch.arange(0, 32, bits)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)
    order = torch.arange(izeros.shape[-1], dtype=torch.int32).view(-1, 32 // bits)
    order = order[:, AWQ_REVERSE_ORDER].view(-1)
    izeros, iweights = izeros[:, order], iweights[:, order]
    iweights = torch.bitwise_and(iweights, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweights - izeros) * scales


def awq_pack(intweight: torch.Tensor, zeros: torch.Tensor, bits: int = 4):
    """AutoAWQ's WQLinear_GEMM packer: intweight [K, N], zeros [G, N] -> (qweight, qzeros)."""
    pack_num = 32 // bits

    def pack(values: torch.Tensor) -> torch.Tensor:
        values = values.to(torch.int64)
        out = torch.zeros(values.shape[0], values.shape[1] // 32 * bits, dtype=torch.int64)
        for col in range(values.shape[1] // pack_num):
            for i in range(pack_num):
                out[:, col] |= values[:, col * pack_num + AWQ_ORDER[i]] << (i * bits)
        return _int32(out)

    return pack(intweight), pack(zeros)


def _int32(words: torch.Tensor) -> torch.Tensor:
    """numpy's uint32 -> int32 reinterpretation, as the packers end."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)

"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum) into the canonical W4A16 layout.

Per linear layer: `qweight` int32 [K / pack, N], values packed along K, value j of a word in
bits [bits*j, bits*(j+1)) (already the canonical order); `qzeros` int32 [G, N / pack] packed
the same way along N; `scales` float16 [G, N]; `g_idx` int32 [K], the group of each input row
(act-order checkpoints permute it). checkpoint_format "gptq" (v1, every writer before
GPTQModel's v2) stores each zero point minus one (wrapping: a zero of 0 reads all ones), so
4-bit symmetric zeros read 7 for 8;
"gptq_v2" stores them as they are. Symmetric or not, the stored zeros are used as written.

The unpacking follows the torch dequantization of AutoGPTQ's and GPTQModel's QuantLinear
(shift each int32 right by bits*j, mask; v1 zero points plus one, masked again; then
scales[g_idx] * (q - zeros[g_idx])); the tests check it against a transcription of that code
on the same random bytes.
"""

from __future__ import annotations

import torch

from kvbatch.engine.quant.layer_tensors import LayerTensors
from kvbatch.engine.quant.linear import WNA16Linear
from kvbatch.engine.quant.scheme import WNA16
from kvbatch.engine.quant.wna16_layout import WNA16Weights, unpack_columns


def load_gptq_linear(
    t: LayerTensors, scheme: WNA16, dtype: torch.dtype, zeros_minus_one: bool
) -> WNA16Linear:
    bias = t.optional("bias")
    weights = gptq_weights(t, scheme, dtype, zeros_minus_one)
    return WNA16Linear(weights, None if bias is None else bias.to(dtype))


def gptq_weights(
    t: LayerTensors, scheme: WNA16, dtype: torch.dtype, zeros_minus_one: bool
) -> WNA16Weights:
    t.expect(["qweight", "qzeros", "scales"], optional=["g_idx"])
    bits, pack = scheme.bits, 32 // scheme.bits
    qweight = t.get("qweight", (torch.int32,))
    scales = t.get("scales")
    k, n = qweight.shape[0] * pack, qweight.shape[1]
    group_size = scheme.group_size or k
    groups = -(-k // group_size)
    t.check_shape("scales", (groups, n), scales)
    qzeros = t.get("qzeros", (torch.int32,))
    t.check_shape("qzeros", (groups, n // pack), qzeros)
    zeros = unpack_columns(qzeros, bits)
    if zeros_minus_one:  # a true zero of 0 was stored as -1: all ones, back to 0 here
        zeros = (zeros + 1) & ((1 << bits) - 1)
    g_idx = t.optional("g_idx")
    if g_idx is not None:
        t.check_shape("g_idx", (k,), g_idx)
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group_size):
            g_idx = None  # the trivial order: no gather needed
    elif scheme.act_order:
        raise t.error("desc_act is set but the layer has no g_idx")
    return WNA16Weights(
        qweight=qweight,
        scales=scales.to(dtype),
        zeros=zeros.to(dtype),
        g_idx=g_idx,
        group_size=group_size,
        bits=bits,
    )

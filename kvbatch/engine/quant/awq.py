"""AWQ checkpoints (AutoAWQ's GEMM layout) into the canonical W4A16 layout.

Per linear layer: `qweight` int32 [K, N / 8], eight 4-bit values packed along N, where value i
of a word (bits [4i, 4i + 4)) holds column AWQ_ORDER[i] of its block of eight; `qzeros` int32
[G, N / 8] packed the same way; `scales` [G, N]. w = (q - zero) * scale, groups contiguous
along K (no act-order). The order and the unpacking follow AutoAWQ's packer and GPTQModel's
and vLLM's `unpack_awq` / AWQ_REVERSE_ORDER; the tests check against a transcription of that
code on the same random bytes.
"""

from __future__ import annotations

import torch

from kvbatch.engine.quant.layer_tensors import LayerTensors
from kvbatch.engine.quant.linear import WNA16Linear
from kvbatch.engine.quant.scheme import WNA16
from kvbatch.engine.quant.wna16_layout import WNA16Weights, pack_rows, unpack_columns

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the column each nibble of a word holds


def load_awq_linear(t: LayerTensors, scheme: WNA16, dtype: torch.dtype) -> WNA16Linear:
    bias = t.optional("bias")
    return WNA16Linear(awq_weights(t, scheme, dtype), None if bias is None else bias.to(dtype))


def awq_weights(t: LayerTensors, scheme: WNA16, dtype: torch.dtype) -> WNA16Weights:
    t.expect(["qweight", "qzeros", "scales"])
    qweight = t.get("qweight", (torch.int32,))
    scales = t.get("scales")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group_size = scheme.group_size or k
    groups = -(-k // group_size)
    t.check_shape("scales", (groups, n), scales)
    qzeros = t.get("qzeros", (torch.int32,))
    t.check_shape("qzeros", (groups, n // 8), qzeros)
    q = unpack_columns(qweight, 4, AWQ_ORDER)  # [K, N]
    zeros = unpack_columns(qzeros, 4, AWQ_ORDER)  # [G, N]
    return WNA16Weights(
        qweight=pack_rows(q, 4),
        scales=scales.to(dtype),
        zeros=zeros.to(dtype),
        g_idx=None,
        group_size=group_size,
        bits=4,
    )

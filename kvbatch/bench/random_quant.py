"""The decoder linears of a random-weight benchmark model, quantized one layer at a time by a
format's writer (rtn_w4a16.py, fp8_block.py).

What is quantized is what published quantized checkpoints quantize: the attention and MLP
projections of every decoder layer. Embeddings, norms, the output projection and MoE routers
stay in float. A mixture-of-experts model's stacked experts (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I], as transformers names them) are written one
projection per expert (`mlp.experts.3.gate_proj.*`), as the quantization tools write MoE
checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

QUANTIZED_SUFFIXES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)

LayerWriter = Callable[[torch.Tensor], dict[str, torch.Tensor]]
"""One linear weight [N, K] (on the quantizing device) -> the format's tensors, by suffix."""


def quantize_decoder_linears(
    weights: dict[str, torch.Tensor], write_layer: LayerWriter
) -> dict[str, torch.Tensor]:
    """A float state dict -> the same with every decoder linear's `weight` replaced by what
    `write_layer` makes of it; the rest unchanged. The writing runs on the GPU when there is
    one (a few seconds for billions of weights), the result is on the CPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict[str, torch.Tensor] = {}
    for name, tensor in per_expert_linears(weights):
        if not name.endswith(QUANTIZED_SUFFIXES):
            out[name] = tensor
            continue
        prefix = name.removesuffix("weight")
        out.update({prefix + k: v.cpu() for k, v in write_layer(tensor.to(device)).items()})
    return out


def per_expert_linears(weights: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `weights`, stacked experts split into one linear per expert."""
    for name, tensor in weights.items():
        if name.endswith(".experts.gate_up_proj"):
            base, inter = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e, w in enumerate(tensor):
                yield f"{base}{e}.gate_proj.weight", w[:inter]
                yield f"{base}{e}.up_proj.weight", w[inter:]
        elif name.endswith(".experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, w in enumerate(tensor):
                yield f"{base}{e}.down_proj.weight", w
        else:
            yield name, tensor

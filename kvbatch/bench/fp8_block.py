"""Block-wise FP8 for the benchmarks' random-weight models, written as Qwen3-*-FP8 and
DeepSeek-V3 checkpoints are (`quant_method: fp8` with `weight_block_size`).

Each decoder linear weight w [N, K] (random_quant.py says which) is cut into B x B tiles
(B = 128, as released; 32 for tiny models; the last tiles partial); a tile's scale maps its
largest magnitude to 448, E4M3's largest value:

    weight[n, k] = e4m3(w[n, k] / s[n // B, k // B]),   weight_scale_inv = s (it multiplies)

Activations are quantized at run time per token and group of B inputs. For speed rows and
the GPU greedy check (the block-scaled kernels against the reference path); a real checkpoint
comes from its own tools (tests/engine/quant write them with compressed-tensors).
"""

from __future__ import annotations

from typing import Any

import torch

from kvbatch.bench.random_quant import quantize_decoder_linears

BLOCK = 128  # the released checkpoints'
SMALL_BLOCK = 32  # for tiny models: an MoE expert's gate and up rows must fill whole blocks
FP8_MAX = 448.0


def block_size_for(dims: list[int]) -> int:
    """BLOCK when it divides every projection dimension (real models), else SMALL_BLOCK."""
    return BLOCK if all(d % BLOCK == 0 for d in dims) else SMALL_BLOCK


def fp8_block_quantization_config(block: int = BLOCK) -> dict[str, Any]:
    """config.json's quantization_config for the tensors quantize_fp8_block writes."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }


def quantize_fp8_block(
    weights: dict[str, torch.Tensor], block: int = BLOCK
) -> dict[str, torch.Tensor]:
    """A float state dict -> the same with every decoder linear as block FP8 (weight,
    weight_scale_inv); the rest unchanged."""
    return quantize_decoder_linears(weights, lambda w: fp8_block_tensors(w, block))


def fp8_block_tensors(weight: torch.Tensor, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """One linear weight [N, K] -> {weight (E4M3 [N, K]), weight_scale_inv (float32
    [ceil(N / block), ceil(K / block)])}."""
    n, k = weight.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block, device=weight.device)
    padded[:n, :k] = weight.float()
    tiles = padded.reshape(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)  # [rows, cols]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(rows * block, cols * block)[:n, :k].to(torch.float8_e4m3fn)
    return {"weight": q.contiguous(), "weight_scale_inv": scale.contiguous()}

"""The layers' Triton path (kernels and GEMMs; TRITON_INTERPRET=1 on the CPU) with quantized
layers: their projections stay apart and run kvbatch.kernels' GEMMs, and the greedy tokens are
those of the torch path (the dequantized weights)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.quant.linear import QuantLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static", "int8-w8a8", "w4a16-asym"])
def test_triton_path_runs_quantized_layers(ct_checkpoints, scheme):
    path = str(ct_checkpoints(scheme))
    prompts = [[5, 9, 14, 200, 31], list(range(40, 73))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            path,
            device=DEVICE,
            dtype="float32",
            attention_backend=backend,
            num_kv_blocks=64,
            cuda_graphs=False,
        )
        runs[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    layer = llm.engine.model.model.layers[0]
    attn = layer.self_attn
    assert isinstance(attn.q_proj, QuantLinear) and attn.qkv_proj.weight is None
    assert attn.q_proj.backend == "triton"  # the triton path runs the kernels' GEMMs
    assert runs["triton"] == runs["torch"]

"""A DeepSeek-V3 checkpoint in DeepSeek's block FP8 (`quant_method: fp8`, `weight_block_size`,
`weight_scale_inv` per block; router, norms, embeddings and lm_head in float), written by
transformers' own FineGrainedFP8 quantizer (its `Fp8Quantize` op, which transformers runs to
write such files) from the tiny float DeepSeek-V3, and read back by transformers'
FineGrainedFP8 dequantization (on the CPU it dequantizes on load) as the reference: every
weight we hold (the attention's, the dense MLP's, each expert's, the shared experts') equals
transformers' dequantized weight exactly, and the model runs, with activations quantized per
token and group, close to transformers' float forward of those weights."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Quantize

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.linear import Fp8BlockLinear
from tests.engine.core.test_llm import random_prompts
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_logits, hf_model

BLOCK = [8, 16]  # [rows, columns]: divides every tiny projection (transformers' needs whole blocks)
FLOAT_PARTS = ("norm", "embed_tokens", "lm_head", "mlp.gate.", "e_score_correction_bias")


@pytest.fixture(scope="module")
def deepseek_fp8(tiny_models, tmp_path_factory):
    src = tiny_models("deepseek-v3")
    dst = tmp_path_factory.mktemp("deepseek-fp8") / "m"
    shutil.copytree(src, dst)
    config = FineGrainedFP8Config(weight_block_size=BLOCK)
    quantize = Fp8Quantize(SimpleNamespace(quantization_config=config))
    state = load_file(dst / "model.safetensors")
    out = {}
    for name, tensor in state.items():
        if name.endswith(".weight") and not any(p in name for p in FLOAT_PARTS):
            out.update(quantize.convert({name: tensor}))
        else:
            out[name] = tensor
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {  # DeepSeek-V3's, with the tiny block
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": BLOCK,
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_every_weight_is_transformers_dequantized_weight(deepseek_fp8):
    state = load_file(deepseek_fp8 / "model.safetensors")
    assert state["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in state
    loaded = load_model(deepseek_fp8, torch.float32, torch.device("cpu"))
    assert loaded.quantization_method == "fp8"
    ours, reference = loaded.model, hf_model(deepseek_fp8)
    linears = [(n, m) for n, m in ours.named_modules() if isinstance(m, Fp8BlockLinear)]
    # 3 layers x 5 attention projections, 3 dense MLP ones, 2 x 3 shared experts'
    assert len(linears) == 3 * 5 + 3 + 2 * 3
    for name, layer in linears:
        assert layer.block == tuple(BLOCK)
        assert torch.equal(layer.float_weight, reference.get_submodule(name).weight), name
    for i in (1, 2):  # the routed experts, stacked as transformers stacks them
        experts = ours.model.layers[i].mlp.experts
        ref = reference.model.layers[i].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(experts, proj)
            dense = torch.stack([w.dequantize_expert(e, torch.float32) for e in range(8)])
            assert torch.equal(dense, getattr(ref, proj)), (i, proj)


def test_runs_close_to_transformers_float_forward(deepseek_fp8):
    """Activations quantized to E4M3 per token and group of 16 (as DeepSeek's kernels do;
    transformers' CPU reference runs the dequantized weights in float) move the logits of
    this tiny random model by about a tenth on average; most greedy tokens agree, and the
    engine decodes. The weights themselves are checked exactly above."""
    model = load_model(deepseek_fp8, torch.float32, torch.device("cpu")).model
    ids = random_prompts(512, (40,), seed=4)[0]
    ours, ref = prefill_logits(model, ids, 16), hf_logits(deepseek_fp8, ids)
    assert (ours - ref).abs().mean() < 0.15 * ref.abs().mean()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.7
    llm = LLM(str(deepseek_fp8), device="cpu", num_kv_blocks=32, max_model_len=128)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 6

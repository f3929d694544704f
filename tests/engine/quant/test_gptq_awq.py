"""GPTQ and AWQ: the engine's unpacking against the libraries' published dequantization on the
same bytes (random words, every bit pattern), and whole checkpoints packed by their published
packers against a float model holding the libraries' dequantized weights."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.awq import awq_weights
from kvbatch.engine.quant.gptq import gptq_weights
from kvbatch.engine.quant.layer_tensors import LayerTensors
from kvbatch.engine.quant.linear import WNA16Linear
from kvbatch.engine.quant.scheme import WNA16
from tests.engine.model.test_model import prefill_logits
from tests.engine.quant import published_wna16 as published
from tests.engine.quant.wna16_checkpoints import build_wna16_checkpoint
from tests.reference import hf_greedy, hf_logits

K, N, GROUP = 256, 96, 64


def random_words(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 31), 1 << 31, shape, generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_unpacking_matches_autogptq(bits, v1, act_order):
    pack = 32 // bits
    g = torch.Generator().manual_seed(bits)
    qweight = random_words(K // pack, N, seed=1)
    qzeros = random_words(K // GROUP, N // pack, seed=2)
    scales = torch.rand(K // GROUP, N, generator=g) * 0.1
    g_idx = torch.arange(K, dtype=torch.int32) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    t = LayerTensors(
        "layer", "gptq", dict(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    )
    scheme = WNA16(bits, GROUP, symmetric=False, act_order=act_order)
    ours = gptq_weights(t, scheme, torch.float32, zeros_minus_one=v1)
    assert (ours.g_idx is None) == (not act_order)  # the trivial order needs no gather
    want = published.gptq_dequantize(qweight, qzeros, scales, g_idx, bits, v1)
    torch.testing.assert_close(ours.dequantize().t(), want, atol=0, rtol=0)


def test_awq_unpacking_matches_autoawq():
    g = torch.Generator().manual_seed(0)
    qweight = random_words(K, N // 8, seed=3)
    qzeros = random_words(K // GROUP, N // 8, seed=4)
    scales = torch.rand(K // GROUP, N, generator=g) * 0.1
    t = LayerTensors("layer", "awq", dict(qweight=qweight, qzeros=qzeros, scales=scales))
    ours = awq_weights(t, WNA16(4, GROUP, symmetric=False), torch.float32)
    want = published.awq_dequantize(qweight, qzeros, scales, 4, GROUP)
    torch.testing.assert_close(ours.dequantize().t(), want, atol=0, rtol=0)


CHECKPOINTS = [("gptq", 4, True), ("gptq", 8, False), ("gptq_v2", 4, True), ("awq", 4, False)]


@pytest.fixture(scope="module")
def wna16_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("wna16")
    return {c: build_wna16_checkpoint(*c, path=root / "-".join(map(str, c))) for c in CHECKPOINTS}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, ids=lambda c: "-".join(map(str, c)))
def test_checkpoint_matches_its_dequantized_twin(wna16_checkpoints, checkpoint):
    quantized, reference = wna16_checkpoints[checkpoint]
    loaded = load_model(quantized, torch.float32, torch.device("cpu"))
    assert loaded.quantization_method == checkpoint[0].removesuffix("_v2")
    assert isinstance(loaded.model.model.layers[1].mlp.up_proj, WNA16Linear)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 512, (40,), generator=g).tolist()
    ours = prefill_logits(loaded.model, ids, 16)
    torch.testing.assert_close(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)


def test_act_order_gptq_greedy_tokens_through_the_engine(wna16_checkpoints):
    quantized, reference = wna16_checkpoints[("gptq", 4, True)]
    prompts = [[5, 9, 14, 200, 31], list(range(40, 73))]
    want = hf_greedy(reference, prompts, max_new_tokens=10, ignore_eos=True)
    llm = LLM(model=str(quantized), device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want

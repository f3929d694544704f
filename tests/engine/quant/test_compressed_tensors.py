"""compressed-tensors checkpoints, as the library writes them, against transformers loading the
same files (compressed-tensors dequantizing them on the CPU): every position's logits, and
greedy tokens through the whole engine."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.quant.linear import Fp8BlockLinear, Fp8Linear, Int8Linear, WNA16Linear
from tests.engine.model.test_model import prefill_logits
from tests.engine.quant.ct_checkpoints import (
    SCHEMES,
    build_ct_checkpoint,
    reference_model,
    wide_config,
)

LAYER_TYPE = {
    "fp8-static": Fp8Linear,
    "fp8-dynamic": Fp8Linear,
    "int8-w8a8": Int8Linear,
    "w4a16": WNA16Linear,
    "w4a16-asym": WNA16Linear,
    "w8a16": WNA16Linear,
    "w4a16-channel": WNA16Linear,
    "fp8-block": Fp8BlockLinear,
    "fp8-block-n48": Fp8BlockLinear,
}


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_logits_match_transformers(ct_checkpoints, scheme):
    """Same dequantized weights and the same activation quantization: the logits agree to
    float32 rounding, whether the prompt runs whole or in chunks over the paged cache."""
    path = ct_checkpoints(scheme)
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    assert loaded.quantization_method == "compressed-tensors"
    layers = loaded.model.model.layers
    assert isinstance(layers[0].self_attn.q_proj, LAYER_TYPE[scheme])
    assert isinstance(layers[1].mlp.down_proj, LAYER_TYPE[scheme])
    assert type(loaded.model.lm_head) is torch.nn.Linear  # config.json's `ignore`
    ids = prompt(45, seed=3)
    with torch.no_grad():
        ref = reference_model(path)(torch.tensor([ids])).logits[0]
    for chunk in (45, 16):
        ours = prefill_logits(loaded.model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=f"chunk={chunk}")
        torch.testing.assert_close(
            ours.log_softmax(-1), ref.log_softmax(-1), atol=1e-4, rtol=0, msg="logprobs"
        )


def test_fp8_block_preset_on_128_wide_layers_matches_transformers(tmp_path):
    """compressed-tensors' FP8_BLOCK preset itself: [128, 128] weight blocks (k/v_proj's 64
    rows a partial block) and activation groups of 128, on a model whose every K is a
    multiple of 128."""
    path = build_ct_checkpoint("fp8-block-128", tmp_path / "ckpt", config=wide_config())
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    attn = loaded.model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, Fp8BlockLinear) and attn.k_proj.block == (128, 128)
    assert attn.k_proj.weight_scale.shape == (1, 1) and attn.q_proj.in_features == 128
    ids = prompt(45, seed=5)
    with torch.no_grad():
        ref = reference_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, ids, 16), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("scheme", ["fp8-static", "int8-w8a8", "w4a16-asym", "fp8-block"])
def test_greedy_tokens_match_transformers(ct_checkpoints, scheme):
    """Through the engine (batching, paged KV, sampler): transformers' greedy tokens."""
    path = ct_checkpoints(scheme)
    model = reference_model(path)
    prompts = [prompt(n, seed=n) for n in (5, 17, 33)]
    want = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        want.append(out[0, len(ids) :].tolist())
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_quantized_weights_are_counted_at_their_size(ct_checkpoints, tiny_models):
    """stats() names the method and the weights' bytes: 4-bit layers take about an eighth of
    float32's room, so the whole model (float embeddings and lm_head included) shrinks."""
    w4 = LLM(model=str(ct_checkpoints("w4a16")), device="cpu", num_kv_blocks=64).stats()
    fp = LLM(model=str(tiny_models("llama-gqa")), device="cpu", num_kv_blocks=64).stats()
    assert (w4.quantization, fp.quantization) == ("compressed-tensors", None)
    # llama-gqa: 2 layers of 40,960 linear weights, 2 x 32,768 embedding/lm_head, norms
    linear_bytes = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128) * 4
    assert fp.weight_bytes - w4.weight_bytes > 0.7 * linear_bytes


def test_the_startup_log_names_the_method_and_weight_size(ct_checkpoints, caplog):
    with caplog.at_level("INFO", logger="kvbatch.engine.core.llm_engine"):
        llm = LLM(model=str(ct_checkpoints("fp8-dynamic")), device="cpu", num_kv_blocks=64)
    mib = llm.stats().weight_bytes / (1 << 20)
    assert f"weights: {mib:.1f} MiB (quantized: compressed-tensors)" in caplog.text


def test_a_layer_two_groups_target_gets_the_most_specific_ones_scheme(tmp_path):
    """group_0 targets "Linear" (4-bit packed), group_1 "re:...down_proj$" (FP8 W8A8): the
    library quantizes down_proj with the pattern's scheme and saves a mixed-precision
    checkpoint; the engine picks the same scheme per layer and gives transformers' logits."""
    path = build_ct_checkpoint(
        "w4a16", tmp_path / "ckpt", more_groups={"fp8-dynamic": [r"re:.*mlp\.down_proj$"]}
    )
    loaded = load_model(path, torch.float32, torch.device("cpu"))
    for layer in loaded.model.model.layers:
        assert isinstance(layer.mlp.down_proj, Fp8Linear)
        assert isinstance(layer.mlp.up_proj, WNA16Linear)
        assert isinstance(layer.self_attn.o_proj, WNA16Linear)
    ids = prompt(45, seed=4)
    with torch.no_grad():
        ref = reference_model(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, ids, 16), ref, atol=1e-4, rtol=0)

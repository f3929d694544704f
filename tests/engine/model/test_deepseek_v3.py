"""DeepSeek-V3 (engine/models/deepseek_v3.py) against transformers in float32: multi-head
latent attention with q_lora on and off, interleaved YaRN RoPE with mscale in the softmax
scale, a dense first layer, grouped sigmoid routing with a non-zero correction bias, shared
experts, and an MTP layer in the file that the load drops. Through the engine: prefill,
chunked prefill, absorbed decode, prefix caching, shared-prefix decode groups, preemption and
n-gram speculation, and the latent cache's bytes per token."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvbatch.engine.layers.latent_attention as latent_layer
from kvbatch.engine import LLM
from kvbatch.engine.layers.grouped_moe import GroupedMoeBlock
from kvbatch.engine.layers.latent_attention import LatentAttention
from kvbatch.engine.layers.mlp import GatedMLP
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.models.deepseek_v3 import MlaForCausalLM
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.engine.model.family_checks import (
    CPU,
    GREEDY,
    assert_logits_match,
    assert_ngram_spec_matches,
    assert_triton_matches,
)
from tests.engine.model.test_model import prefill_logits
from tests.reference import (
    assert_greedy_matches_transformers,
    assert_logprobs_match_transformers,
    hf_greedy,
    hf_logits,
)

DEEPSEEK_KINDS = ("deepseek-v3", "deepseek-v3-no-qlora")

MLA_ENGINE_SETTINGS = {
    "cache": dict(enable_prefix_caching=True),
    "chunked": dict(enable_prefix_caching=True, max_num_batched_tokens=7),
    # preemption: a few requests' worth of blocks
    "tiny-pool": dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=64),
}
"""Engine settings the MLA families' greedy tokens are checked under (keys: test ids)."""


def test_config_and_modules(tiny_models):
    loaded = load_model(tiny_models("deepseek-v3"), torch.float32, CPU)
    cfg, model = loaded.config, loaded.model
    assert isinstance(model, MlaForCausalLM) and cfg.is_latent
    attention = cfg.family.attention
    assert (attention.kv_lora_rank, attention.qk_rope_head_dim, attention.q_lora_rank) == (
        32,
        8,
        48,
    )
    assert cfg.kv_shape(0) == (1, 40) and cfg.kv_planes(0) == 1
    assert cfg.family.rope.head_dim == 8 and cfg.family.rope.rope_type == "yarn"
    mscale = 0.1 * torch.log(torch.tensor(4.0)).item() + 1  # YaRN's, mscale_all_dim 1
    assert attention.scale == pytest.approx(24**-0.5 * mscale**2)
    layers = model.model.layers
    assert isinstance(layers[0].self_attn, LatentAttention)
    assert isinstance(layers[0].mlp, GatedMLP) and isinstance(layers[1].mlp, GroupedMoeBlock)
    assert len(layers) == 3  # the MTP layer of the file (layer 3) was dropped
    bias = layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().max() > 0.1
    assert hasattr(layers[0].self_attn, "q_a_proj") and not hasattr(layers[0].self_attn, "q_proj")
    routing = cfg.family.routing
    assert (routing.scoring, routing.num_groups, routing.topk_groups) == ("sigmoid", 4, 2)
    bf16 = load_model(tiny_models("deepseek-v3"), torch.bfloat16, CPU).model.model.layers[1]
    assert bf16.mlp.gate.e_score_correction_bias.dtype == torch.float32  # as transformers keeps it
    assert bf16.mlp.gate.weight.dtype == torch.bfloat16
    plain = load_model(tiny_models("deepseek-v3-no-qlora"), torch.float32, CPU).model
    assert hasattr(plain.model.layers[0].self_attn, "q_proj")
    assert isinstance(plain.model.layers[0].mlp, GroupedMoeBlock)


@pytest.mark.parametrize("kind", DEEPSEEK_KINDS)
def test_logits_match_transformers(tiny_models, kind):
    """Whole, chunked and token-by-token prefill (the last one runs the absorbed decode)."""
    assert_logits_match(tiny_models(kind))


def _edit(src, dst, config_change=None, tensor_change=None):
    shutil.copytree(src, dst)
    if config_change:
        cfg = json.loads((dst / "config.json").read_text()) | config_change
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_change:
        tensors = load_file(dst / "model.safetensors")
        tensor_change(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _zero_correction_bias(tensors):
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.zeros_like(tensors[name])


@pytest.mark.parametrize(
    "config_change, tensor_change",
    [
        (None, _zero_correction_bias),
        (dict(topk_group=4), None),
        (dict(rope_interleave=False), None),
        (dict(routed_scaling_factor=1.0), None),
    ],
    ids=["correction-bias", "all-groups", "rope-halves", "routed-scaling"],
)
def test_each_feature_changes_the_logits(tiny_models, tmp_path, config_change, tensor_change):
    """Each feature is really applied: changed, the logits change and still equal
    transformers' for the changed checkpoint."""
    src = tiny_models("deepseek-v3")
    changed = _edit(src, tmp_path / "m", config_change, tensor_change)
    ids = random_prompts(512, (40,), seed=4)[0]
    a = prefill_logits(load_model(src, torch.float32, CPU).model, ids, 40)
    b = prefill_logits(load_model(changed, torch.float32, CPU).model, ids, 40)
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(b, hf_logits(changed, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("settings", MLA_ENGINE_SETTINGS.values(), ids=MLA_ENGINE_SETTINGS.keys())
def test_greedy_matches_transformers(tiny_models, settings):
    assert_greedy_matches_transformers(
        tiny_models("deepseek-v3"), shared_prefix_prompts(), GREEDY, settings
    )


def test_greedy_without_q_lora_matches_transformers(tiny_models):
    assert_greedy_matches_transformers(
        tiny_models("deepseek-v3-no-qlora"), shared_prefix_prompts(), GREEDY,
        MLA_ENGINE_SETTINGS["chunked"],
    )  # fmt: skip


def test_logprobs_match_transformers(tiny_models):
    prompt = random_prompts(512, (30,), seed=8)[0]
    assert_logprobs_match_transformers(
        tiny_models("deepseek-v3"), prompt, num_kv_blocks=16, max_model_len=128
    )


def test_shared_prefix_decodes_match_transformers(tiny_models, monkeypatch):
    """Decodes sharing a prefix read its latents once per group (merged by log-sum-exp with
    each row's own part) and give transformers' tokens."""
    calls = []
    real = latent_layer.latent_cascade_decode
    monkeypatch.setattr(
        latent_layer,
        "latent_cascade_decode",
        lambda *a, **k: calls.append(len(a[5])) or real(*a, **k),
    )
    path = tiny_models("deepseek-v3")
    g = torch.Generator().manual_seed(4)
    doc = torch.randint(3, 512, (40,), generator=g).tolist()
    prompts = [doc + torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 6, 17, 30)]
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_model_len=128)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert calls and max(calls) >= 1  # the grouped path ran
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)


def test_ngram_speculative_decoding_matches_transformers(tiny_models):
    assert_ngram_spec_matches(tiny_models("deepseek-v3"))


def test_triton_backend_matches_transformers(tiny_models):
    assert_triton_matches(tiny_models("deepseek-v3"))


def test_latent_cache_bytes_per_token(tiny_models, caplog):
    """One [1, blocks, block_size, 1, R + P] tensor a layer, and the startup line's bytes per
    token are (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes."""
    with caplog.at_level(logging.INFO, logger="kvbatch.engine"):
        llm = LLM(str(tiny_models("deepseek-v3")), device="cpu", num_kv_blocks=20)
    want = (32 + 8) * 3 * 4  # float32 on the CPU
    assert llm.engine.kv_bytes_per_token == want
    assert f"{want:,} bytes per token" in caplog.text
    caches = llm.engine.runner.kv_caches
    assert len(caches) == 3 and all(c.shape == (1, 20, 16, 1, 40) for c in caches)


def test_fp8_kv_cache_is_refused(tiny_models):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported for Deepseek"):
        LLM(str(tiny_models("deepseek-v3")), device="cpu", kv_cache_dtype="fp8")

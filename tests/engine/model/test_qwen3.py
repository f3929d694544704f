"""Qwen3 (dense) against transformers: per-head q/k RMSNorm before RoPE, no qkv bias, head_dim
from the config; logits within 1e-4 in float32 and the same greedy tokens and logprobs through
the engine with prefix caching and chunked prefill."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from tests.engine.core.test_llm import random_prompts, shared_prefix_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import (
    assert_greedy_matches_transformers,
    assert_logprobs_match_transformers,
    hf_greedy,
    hf_logits,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_config_reads_head_dim_and_qk_norm(tiny_models):
    cfg = load_model(tiny_models("qwen3"), torch.float32, torch.device("cpu")).config
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.moe is None
    assert cfg.tie_word_embeddings


def test_logits_match_transformers(tiny_models):
    path = tiny_models("qwen3")
    model = load_model(path, torch.float32, torch.device("cpu")).model
    ids = random_prompts(512, (53,), seed=3)[0]
    ref = hf_logits(path, ids)
    for chunk in (53, 16, 7, 1):  # whole prompt, block-sized, odd chunks, token by token
        ours = prefill_logits(model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0, msg=f"chunk={chunk}")


def test_qk_norm_weights_are_used(tiny_models, tmp_path):
    """A checkpoint whose q_norm weights are changed gives other logits: the norm is applied
    with the checkpoint's weights, not skipped or left at ones."""
    from safetensors.torch import load_file, save_file

    src = tiny_models("qwen3")
    shutil.copytree(src, tmp_path / "m")
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    ids = random_prompts(512, (9,), seed=4)[0]
    a = prefill_logits(load_model(src, torch.float32, torch.device("cpu")).model, ids, 9)
    b = prefill_logits(load_model(tmp_path / "m", torch.float32, torch.device("cpu")).model, ids, 9)
    assert (a - b).abs().max() > 1e-3
    torch.testing.assert_close(b, hf_logits(tmp_path / "m", ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=True, max_num_batched_tokens=7),  # chunked prefill
        dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=64),  # preemption
    ],
    ids=["cache", "chunked", "tiny-pool"],
)
def test_greedy_matches_transformers(tiny_models, engine_args):
    path = tiny_models("qwen3")
    assert_greedy_matches_transformers(path, shared_prefix_prompts(), GREEDY, engine_args)


def test_logprobs_are_transformers(tiny_models):
    assert_logprobs_match_transformers(
        tiny_models("qwen3"), shared_prefix_prompts()[0], num_kv_blocks=64, max_model_len=256
    )


def test_triton_backend_matches_transformers(tiny_models):
    """The layers' Triton path (engine/layers/) norms q and k per head too."""
    path = tiny_models("qwen3")
    prompts = random_prompts(512, (7, 30, 18), seed=5)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="triton")
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.engine.runner.backend.name == "triton"
    assert got == hf_greedy(path, prompts, GREEDY.max_tokens, ignore_eos=True)

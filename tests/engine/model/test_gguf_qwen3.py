"""Qwen3 and Qwen3-MoE from GGUF files (transformers' GGUF reader, experts as it stacks them):
the same logits as transformers on the same file and on the Hugging Face folder it was written
from, and the same greedy tokens through the engine."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from tests.engine.core.test_llm import random_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_greedy, hf_logits
from tests.tiny_gguf import GGUF_KINDS, build_tiny_gguf


@pytest.fixture(scope="module", params=GGUF_KINDS)
def gguf_model(request, tmp_path_factory):
    return build_tiny_gguf(request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(gguf_model):
    hf_folder, gguf_path = gguf_model
    loaded = load_model(gguf_path, torch.float32, torch.device("cpu"))
    assert loaded.config.qk_norm and loaded.config.head_dim == 128
    assert loaded.tokenizer is not None and loaded.eos_token_ids == (2,)
    ids = random_prompts(512, (37,), seed=6)[0]
    ours = prefill_logits(loaded.model, ids, 16)
    torch.testing.assert_close(ours, hf_logits(gguf_path, ids), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, hf_logits(hf_folder, ids), atol=1e-4, rtol=0)


def test_greedy_matches_transformers(gguf_model):
    _, gguf_path = gguf_model
    prompts = random_prompts(512, (3, 20, 41), seed=7)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(gguf_path), device="cpu", num_kv_blocks=32, max_model_len=128)
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert got == hf_greedy(gguf_path, prompts, params.max_tokens, ignore_eos=True)

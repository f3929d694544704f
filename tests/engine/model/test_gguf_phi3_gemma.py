"""Phi-3, Gemma 2 and Gemma 3 from GGUF files written as llama.cpp's converter writes them (Phi-3's
fused attn_qkv and [gate; up] ffn_up, Gemma's norms stored + 1 and the head tied to the
embedding): the same logits as transformers on the same file and on the Hugging Face folder it
was written from, the same greedy tokens through the engine; and files stating what
transformers' reader leaves out refused by name (engine/model/gguf.py)."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.loader import load_model
from tests.engine.core.test_llm import random_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_greedy, hf_logits
from tests.tiny_gguf import PHI3_GEMMA_GGUF_KINDS, build_tiny_gguf, gguf_config
from tests.tiny_models import SLIDING_WINDOW, tiny_config


@pytest.fixture(scope="module", params=PHI3_GEMMA_GGUF_KINDS)
def gguf_model(request, tmp_path_factory):
    return build_tiny_gguf(request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(gguf_model):
    hf_folder, gguf_path = gguf_model
    loaded = load_model(gguf_path, torch.float32, torch.device("cpu"))
    assert loaded.tokenizer is not None and loaded.eos_token_ids == (2,)
    ids = random_prompts(512, (37,), seed=6)[0]  # longer than the Gemmas' window (24)
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


def _phi3_with_window():
    config = gguf_config("phi3")
    config.sliding_window = SLIDING_WINDOW
    return config


# Checkpoints whose GGUF file states a value transformers' reader does not read, and the words
# of the engine's refusal: tests.tiny_models' own Phi-3 (LongRoPE over 12 of 16 dimensions),
# Gemma 2 (soft-caps 2 and 8) and Gemma 3 (a linear factor on the global layers), and Phi-3 with
# a sliding window.
MISREAD = {
    "phi3-longrope": ("phi3", lambda: tiny_config("phi3"), "LongRoPE factors"),
    "phi3-window": ("phi3", _phi3_with_window, "phi3.attention.sliding_window = 24"),
    "gemma2-softcaps": ("gemma2", lambda: tiny_config("gemma2"), "attn_logit_softcapping = 2"),
    "gemma3-rope-factor": ("gemma3", lambda: tiny_config("gemma3"), "linear with factor 2"),
}


@pytest.mark.parametrize("case", sorted(MISREAD))
def test_file_that_transformers_misreads_is_refused(case, tmp_path):
    kind, config, words = MISREAD[case]
    hf_folder, gguf_path = build_tiny_gguf(kind, tmp_path, config=config())
    ids = random_prompts(512, (37,), seed=6)[0]
    # The premise: transformers runs another model from the file than from the folder.
    assert not torch.allclose(hf_logits(gguf_path, ids), hf_logits(hf_folder, ids), atol=1e-3)
    with pytest.raises(ValueError, match=words):
        load_model(gguf_path, torch.float32, torch.device("cpu"))

"""Llama, Qwen2 and Qwen3 GGUF files keep the RoPE scaling of the checkpoint they were converted
from, which transformers' GGUF reader drops for these architectures.

Files written as llama.cpp's converter writes them (tests/tiny_gguf.py): Llama 3.1's llama3
scaling as the rope_freqs tensor, Qwen3's YaRN and a linear factor as rope.scaling metadata.
transformers runs each file unscaled (the premise, checked); the engine runs the Hugging Face
folder's model. What the engine cannot run is refused naming the key, and the per-pair factors
equal transformers' llama3 frequencies at Llama 3.1 / 3.2's real shapes."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.gguf import GgufFile, complete_config
from kvbatch.engine.model.loader import load_model
from kvbatch.engine.model.rope import inverse_frequencies, rope_config_from_hf
from tests.engine.core.test_llm import random_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_greedy, hf_logits
from tests.tiny_gguf import (
    LLAMA31_ROPE,
    ROPE_GGUF_KINDS,
    build_tiny_gguf,
    gguf_config,
    llama3_rope_freqs,
)
from tests.tiny_models import tiny_config

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Long enough for Llama 3.1's scaled pairs to turn visibly (its slowest unscaled wavelength is
# 2048 positions) and past the tiny YaRN's pretraining length (32).
PROMPT_LEN = 120
LOGGED = {"llama3": "rope_type: 'longrope'", "qwen3-yarn": "'yarn'", "qwen2-linear": "'linear'"}


@pytest.fixture(scope="module", params=ROPE_GGUF_KINDS)
def scaled_model(request, tmp_path_factory):
    return (request.param, *build_tiny_gguf(request.param, tmp_path_factory.mktemp(request.param)))


def test_file_runs_its_checkpoints_rope_scaling(scaled_model, caplog):
    kind, hf_folder, gguf_path = scaled_model
    ids = random_prompts(512, (PROMPT_LEN,), seed=6)[0]
    reference = hf_logits(hf_folder, ids)
    # The premise: transformers runs the file without its scaling.
    assert not torch.allclose(hf_logits(gguf_path, ids), reference, atol=1e-3)
    with caplog.at_level(logging.INFO, logger="kvbatch.engine.model.gguf"):
        loaded = load_model(gguf_path, torch.float32, CPU)
    assert LOGGED[kind] in caplog.text
    torch.testing.assert_close(prefill_logits(loaded.model, ids, 16), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama3", "qwen3-yarn"])
def test_scaled_file_generates_as_its_checkpoint(kind, tmp_path):
    hf_folder, gguf_path = build_tiny_gguf(kind, tmp_path)
    prompts = random_prompts(512, (3, 41, 100), seed=7)
    llm = LLM(model=str(gguf_path), device="cpu", num_kv_blocks=32, max_model_len=128)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == hf_greedy(hf_folder, prompts, GREEDY.max_tokens, ignore_eos=True)


# Llama 3.1 8B and Llama 3.2 3B's RoPE (head_dim, rope_parameters) against transformers' llama3.
LLAMA3_SHAPES = {
    "llama-3.1-8b": (128, LLAMA31_ROPE),
    "llama-3.2-3b": (128, {**LLAMA31_ROPE, "factor": 32.0}),
}


@pytest.mark.parametrize("model", sorted(LLAMA3_SHAPES))
def test_rope_freqs_run_transformers_llama3_frequencies(model):
    head_dim, rope = LLAMA3_SHAPES[model]
    hf = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters=dict(rope),
    )
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, CPU)
    factors = llama3_rope_freqs(hf.to_dict()).tolist()
    hf.rope_parameters = {"rope_type": "default", "rope_theta": rope["rope_theta"]}  # as read
    complete_config(_file("llama", {"rope_freqs.weight": factors}), hf)
    ours = inverse_frequencies(rope_config_from_hf(hf, head_dim).with_context_len(131072))
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)


def _file(architecture: str, rope_factors=None, **metadata) -> GgufFile:
    keys = {f"{architecture}.{k.replace('__', '.')}": v for k, v in metadata.items()}
    return GgufFile(
        architecture, {"general.architecture": architecture, **keys}, rope_factors or {}
    )


def _config(arch: str):
    """transformers' config as its reader builds one from a file of `arch` (no scaling)."""
    return {"llama": tiny_config("llama-gqa"), "qwen2": tiny_config("qwen2")}.get(
        arch
    ) or gguf_config("qwen3")


# llama.cpp's reading of rope metadata the converter does not write today.
READ_AS_LLAMA_CPP = {
    "factor-without-type": (
        _file("llama", rope__scaling__factor=2.0),
        {"rope_type": "linear", "factor": 2.0},
    ),
    "old-linear-key": (
        _file("llama", rope__scale_linear=4.0),
        {"rope_type": "linear", "factor": 4.0},
    ),
    # llama.cpp reads the YaRN length whatever the type; without YaRN it changes nothing
    "type-none": (
        _file("qwen2", rope__scaling__type="none", rope__scaling__original_context_length=64),
        {"rope_type": "default"},
    ),
    "linear-and-rope-freqs": (
        _file(
            "llama",
            {"rope_freqs.weight": [1.0] * 4 + [2.0] * 4},
            rope__scaling__type="linear",
            rope__scaling__factor=2.0,
        ),
        {"rope_type": "longrope", "short_factor": [2.0] * 4 + [4.0] * 4, "attention_factor": 1.0},
    ),
    "yarn-attention-factor": (
        _file(
            "qwen3",
            rope__scaling__type="yarn",
            rope__scaling__factor=4.0,
            rope__scaling__yarn_attn_factor=0.8,
            rope__scaling__yarn_ext_factor=1.0,
        ),
        {"rope_type": "yarn", "original_max_position_embeddings": 512, "attention_factor": 0.8},
    ),
}


@pytest.mark.parametrize("case", sorted(READ_AS_LLAMA_CPP))
def test_rope_metadata_read_as_llama_cpp(case):
    file, expected = READ_AS_LLAMA_CPP[case]
    config = _config(file.architecture)
    complete_config(file, config)
    assert {k: config.rope_parameters.get(k) for k in expected} == expected


# Rope metadata the engine cannot run: refused by key, never run unscaled.
REFUSED = {
    "unknown-type": (
        _file("llama", rope__scaling__type="ntk", rope__scaling__factor=2.0),
        "llama.rope.scaling.type: 'ntk'",
    ),
    "longrope-type": (
        _file("qwen3", rope__scaling__type="longrope"),
        "qwen3.rope.scaling.type: 'longrope'",
    ),
    "yarn-log-multiplier": (
        _file(
            "qwen2",
            rope__scaling__type="yarn",
            rope__scaling__factor=4.0,
            rope__scaling__yarn_log_multiplier=0.1,
        ),
        "qwen2.rope.scaling.yarn_log_multiplier",
    ),
    "yarn-ext-factor": (
        _file(
            "qwen2",
            rope__scaling__type="yarn",
            rope__scaling__factor=4.0,
            rope__scaling__yarn_ext_factor=0.5,
        ),
        "qwen2.rope.scaling.yarn_ext_factor: 0.5",
    ),
    "yarn-without-factor": (
        _file("qwen3", rope__scaling__type="yarn"),
        "'yarn' without rope.scaling.factor",
    ),
    "ntk-alpha": (_file("llama", rope__scaling__alpha=1000.0), "llama.rope.scaling.alpha"),
    "rope-freqs-with-yarn": (
        _file(
            "llama",
            {"rope_freqs.weight": [1.0] * 8},
            rope__scaling__type="yarn",
            rope__scaling__factor=4.0,
        ),
        "rope_freqs.weight: per-pair factors together with YaRN",
    ),
    "rope-freqs-length": (
        _file("llama", {"rope_freqs.weight": [1.0] * 5}),
        "rope_freqs.weight: 5 factors, where heads of 16 have 8 pairs",
    ),
    "partial-rotary": (
        _file("llama", rope__dimension_count=8, attention__key_length=16),
        "llama.rope.dimension_count: 8 rotary dimensions",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_rope_metadata_the_engine_cannot_run_is_refused_by_key(case):
    file, words = REFUSED[case]
    with pytest.raises(ValueError, match=words):
        complete_config(file, _config(file.architecture))

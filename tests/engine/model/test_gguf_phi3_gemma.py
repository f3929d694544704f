"""Phi-3, Gemma 2 and Gemma 3 from GGUF files written as llama.cpp's converter writes them (Phi-3's
fused attn_qkv and [gate; up] ffn_up, Gemma's norms stored + 1 and the head tied to the
embedding).

Files transformers' reader reads completely: the same logits as transformers on the same file
and on the Hugging Face folder it was written from, the same greedy tokens through the engine.
Files stating what transformers' reader leaves out (LongRoPE, a partial rotary factor, a sliding
window, soft-caps, Gemma 3's RoPE scaling and layer pattern) and Gemma's 27B query scale, which
llama.cpp decides by layer count: transformers runs another model from the file, the engine
completes the config from it (engine/model/gguf.py) and runs the folder's model. Values the
engine cannot represent are refused by key."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, Gemma2Config

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.model.gguf import GgufFile, complete_config
from kvbatch.engine.model.loader import load_model
from tests.engine.core.test_llm import random_prompts, tokens
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_greedy, hf_logits
from tests.tiny_gguf import PHI3_GEMMA_GGUF_KINDS, build_tiny_gguf, gguf_config
from tests.tiny_models import PHI3_ORIGINAL_CONTEXT, SLIDING_WINDOW, tiny_config

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=PHI3_GEMMA_GGUF_KINDS)
def gguf_model(request, tmp_path_factory):
    return build_tiny_gguf(request.param, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(gguf_model, caplog):
    hf_folder, gguf_path = gguf_model
    with caplog.at_level(logging.INFO, logger="kvbatch.engine.model.gguf"):
        loaded = load_model(gguf_path, torch.float32, CPU)
    assert not caplog.records  # transformers read everything: nothing to take from the file
    assert loaded.tokenizer is not None and loaded.eos_token_ids == (2,)
    ids = random_prompts(512, (37,), seed=6)[0]  # longer than the Gemmas' window (24)
    ours = prefill_logits(loaded.model, ids, 16)
    torch.testing.assert_close(ours, hf_logits(gguf_path, ids), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, hf_logits(hf_folder, ids), atol=1e-4, rtol=0)


def test_greedy_matches_transformers(gguf_model):
    _, gguf_path = gguf_model
    prompts = random_prompts(512, (3, 20, 41), seed=7)
    llm = LLM(model=str(gguf_path), device="cpu", num_kv_blocks=64, max_model_len=128)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == hf_greedy(gguf_path, prompts, GREEDY.max_tokens, ignore_eos=True)


def _phi3_with_window():
    config = gguf_config("phi3")
    config.sliding_window = SLIDING_WINDOW
    return config


def _gemma(kind: str):
    """tests.tiny_models' Gemma with the query scale llama.cpp gives its size: head_dim."""
    config = tiny_config(kind)
    config.query_pre_attn_scalar = config.head_dim
    return config


def _gemma3_six_layers():
    """gguf_config's Gemma 3 (llama.cpp's default layer pattern) with tiny_models' linear
    factor 2 on the global layers."""
    config = tiny_config("gemma3")
    shape = gguf_config("gemma3")
    config.num_hidden_layers, config.layer_types = shape.num_hidden_layers, shape.layer_types
    config.query_pre_attn_scalar = config.head_dim
    return config


def _gemma2_27b():
    """A Gemma 2 of the 27B's layer count (46) at tiny width: head_dim 8, and hidden / heads
    = 16 its query_pre_attn_scalar (as Gemma 2 27B's 144 = 4608 / 32 over head_dim 128)."""
    config = gguf_config("gemma2")
    shape = Gemma2Config(num_hidden_layers=46)  # the default layer pattern of that depth
    config.num_hidden_layers, config.layer_types = 46, shape.layer_types
    config.head_dim = 8
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    return config


def _file(architecture: str, rope_factors=None, **metadata) -> GgufFile:
    keys = {f"{architecture}.{k.replace('__', '.')}": v for k, v in metadata.items()}
    return GgufFile(
        architecture, {"general.architecture": architecture, **keys}, rope_factors or {}
    )


# Checkpoints whose GGUF file states what transformers' reader leaves out (or, for Gemma 2's
# 27B layer count, whose query scale transformers assumes wrong), and what the engine's log line
# says it took from the file.
COMPLETED = {
    # tests.tiny_models' phi3: Phi-4-mini's LongRoPE over 12 of 16 dimensions.
    "phi3-longrope": ("phi3", lambda: tiny_config("phi3"), "rope_type: 'longrope'"),
    "phi3-window": ("phi3", _phi3_with_window, f"sliding_window={SLIDING_WINDOW}"),
    "gemma2-softcaps": ("gemma2", lambda: _gemma("gemma2"), "attn_logit_softcapping=2.0"),
    "gemma2-27b": ("gemma2", _gemma2_27b, "query_pre_attn_scalar=16"),
    "gemma3-rope-factor": ("gemma3", _gemma3_six_layers, "rope_type: 'linear'"),
    # tests.tiny_models' gemma3: local, local, global (a layer pattern of period 3).
    "gemma3-pattern": ("gemma3", lambda: _gemma("gemma3"), "layer_types="),
}


@pytest.fixture(scope="module", params=sorted(COMPLETED))
def completed_model(request, tmp_path_factory):
    kind, config, _ = COMPLETED[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return (request.param, *build_tiny_gguf(kind, folder, config=config()))


def test_file_transformers_misreads_runs_its_checkpoint(completed_model, caplog):
    case, hf_folder, gguf_path = completed_model
    ids = random_prompts(512, (37,), seed=6)[0]  # past the windows (24)
    reference = hf_logits(hf_folder, ids)
    # The premise: transformers runs another model from the file than from the folder. Its
    # GGUF loader maps tensor names in time quadratic in the depth, so for the 46-layer file
    # the premise is read from its config rather than from its logits.
    if case == "gemma2-27b":
        assert (
            AutoConfig.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name
            ).query_pre_attn_scalar
            != AutoConfig.from_pretrained(hf_folder).query_pre_attn_scalar
        )
    else:
        assert not torch.allclose(hf_logits(gguf_path, ids), reference, atol=1e-3)
    with caplog.at_level(logging.INFO, logger="kvbatch.engine.model.gguf"):
        loaded = load_model(gguf_path, torch.float32, CPU)
    assert COMPLETED[case][2] in caplog.text
    torch.testing.assert_close(prefill_logits(loaded.model, ids, 16), reference, atol=1e-4, rtol=0)
    if case == "phi3-longrope":  # past the pretraining length: the long factors
        ids = random_prompts(512, (PHI3_ORIGINAL_CONTEXT + 36,), seed=3)[0]
        loaded.model.rotary.fit_context(len(ids))
        ours = prefill_logits(loaded.model, ids, 16)
        torch.testing.assert_close(ours, hf_logits(hf_folder, ids), atol=1e-4, rtol=0)


# llama.cpp's query scale on the real Gemmas' shapes (layers, hidden, heads, head_dim) against
# the query_pre_attn_scalar of their Hugging Face configs: head_dim but for the 27B models.
GEMMA_SIZES = {
    "gemma-2-2b": ("gemma2", 26, 2304, 8, 256, 256),
    "gemma-2-9b": ("gemma2", 42, 3584, 16, 256, 256),
    "gemma-2-27b": ("gemma2", 46, 4608, 32, 128, 144),
    "gemma-3-1b": ("gemma3", 26, 1152, 4, 256, 256),
    "gemma-3-4b": ("gemma3", 34, 2560, 8, 256, 256),
    "gemma-3-12b": ("gemma3", 48, 3840, 16, 256, 256),
    "gemma-3-27b": ("gemma3", 62, 5376, 32, 128, 168),
}


@pytest.mark.parametrize("size", sorted(GEMMA_SIZES))
def test_gemma_query_scale_is_llama_cpps(size):
    arch, layers, hidden, heads, head_dim, scalar = GEMMA_SIZES[size]
    config = gguf_config(arch)
    config.num_hidden_layers, config.hidden_size = layers, hidden
    config.num_attention_heads, config.head_dim = heads, head_dim
    file = _file(arch, attention__key_length=head_dim, attention__sliding_window=4096)
    complete_config(file, config)
    assert config.query_pre_attn_scalar == scalar


@pytest.mark.parametrize("case", ["phi3-longrope", "gemma3-rope-factor"])
def test_completed_file_generates_as_its_checkpoint(case, tmp_path):
    kind, config, _ = COMPLETED[case]
    hf_folder, gguf_path = build_tiny_gguf(kind, tmp_path, config=config())
    prompts = random_prompts(512, (3, 20, 41), seed=7)
    # Within Phi-3's pretraining length (64): the short factors, as transformers uses there.
    llm = LLM(model=str(gguf_path), device="cpu", num_kv_blocks=32, max_model_len=64)
    got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got == hf_greedy(hf_folder, prompts, GREEDY.max_tokens, ignore_eos=True)


# What the file states and the engine cannot run as llama.cpp does: the key named.
UNREPRESENTABLE = {
    "longrope-one-tensor": (
        "phi3",
        _file(
            "phi3",
            {"rope_factors_long.weight": [1.0] * 8},
            rope__scaling__original_context_length=64,
        ),
        "rope_factors_long.weight: LongRoPE factors without rope_factors_short.weight",
    ),
    "longrope-no-length": (
        "phi3",
        _file(
            "phi3",
            {n: [1.0] * 8 for n in ("rope_factors_long.weight", "rope_factors_short.weight")},
        ),
        "without phi3.rope.scaling.original_context_length",
    ),
    "odd-rotary": ("phi3", _file("phi3", rope__dimension_count=7), "phi3.rope.dimension_count"),
    "gemma3-yarn": (
        "gemma3",
        _file("gemma3", rope__scaling__type="yarn", rope__scaling__factor=8.0),
        "gemma3.rope.scaling.type: 'yarn'",
    ),
    "gemma2-linear": (
        "gemma2",
        _file("gemma2", rope__scaling__type="linear", rope__scaling__factor=2.0),
        "gemma2.rope.scaling.type: 'linear'",
    ),
    "phi3-yarn": (
        "phi3",
        _file("phi3", rope__scaling__type="yarn", rope__scaling__factor=2.0),
        "phi3.rope.scaling.type: 'yarn'",
    ),
    "gemma3-pattern-length": (
        "gemma3",
        _file("gemma3", attention__sliding_window=24, attention__sliding_window_pattern=[True]),
        "gemma3.attention.sliding_window_pattern: 1 layers where the file has 6",
    ),
}


@pytest.mark.parametrize("case", sorted(UNREPRESENTABLE))
def test_what_the_engine_cannot_represent_is_refused_by_key(case):
    kind, file, words = UNREPRESENTABLE[case]
    with pytest.raises(ValueError, match=words):
        complete_config(file, gguf_config(kind))


L, G = "sliding_attention", "full_attention"
# Gemma 3's local and global layers as llama.cpp reads them from a six-layer file.
GEMMA3_LAYERS = {
    "no-window": (dict(), [G] * 6),  # llama.cpp: no sliding-window layers at all
    "window-0": (dict(attention__sliding_window=0), [G] * 6),
    "default-period": (dict(attention__sliding_window=24), [L] * 5 + [G]),
    "period-3": (
        dict(attention__sliding_window=24, attention__sliding_window_pattern=3),
        [L, L, G, L, L, G],
    ),
    "per-layer": (
        dict(attention__sliding_window=24, attention__sliding_window_pattern=[True, False] * 3),
        [L, G] * 3,
    ),
}


@pytest.mark.parametrize("case", sorted(GEMMA3_LAYERS))
def test_gemma3_layers_are_llama_cpps(case):
    metadata, layer_types = GEMMA3_LAYERS[case]
    config = gguf_config("gemma3")
    complete_config(_file("gemma3", **metadata), config)
    assert config.layer_types == layer_types

"""The random-weight model builder: a config-built Llama folder both engines load, cached."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvbatch.bench.models import (
    LLAMA_3_2_1B,
    MODEL_SPECS,
    TINY_LLAMA,
    build_random_model,
    random_model_dir,
    random_weights,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return random_model_dir(TINY_LLAMA, tmp_path_factory.mktemp("cache"))


def test_llama_3_2_1b_shape_and_parameter_count():
    s = LLAMA_3_2_1B
    assert (s.hidden_size, s.num_hidden_layers, s.intermediate_size) == (2048, 16, 8192)
    assert (s.num_attention_heads, s.num_key_value_heads, s.head_dim) == (32, 8, 64)
    assert (s.vocab_size, s.tie_word_embeddings, s.dtype) == (128256, True, "bfloat16")
    assert s.rope_scaling["rope_type"] == "llama3"
    # docs/BENCHMARKS.md: 1.24 B parameters; checked against transformers' own module tree
    # (on the meta device: nothing is allocated)
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(s.config())
    counted = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    assert s.num_parameters() == counted
    assert round(counted / 1e9, 2) == 1.24


def test_folder_has_config_and_weights_and_no_tokenizer(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors"} <= names
    assert not any(n.startswith("tokenizer") for n in names)
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 64 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is True
    from safetensors.torch import load_file

    weights = load_file(str(tiny_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied, stored once
    assert torch.all(weights["model.norm.weight"] == 1)
    std = weights["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - TINY_LLAMA.initializer_range) < 0.02


def test_cached_folder_is_reused_and_a_changed_spec_gets_its_own(tiny_dir):
    mtime = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    again = random_model_dir(TINY_LLAMA, tiny_dir.parents[1])
    assert again == tiny_dir and (again / "model.safetensors").stat().st_mtime_ns == mtime
    other = dataclasses.replace(TINY_LLAMA, seed=1)
    assert other.key() != TINY_LLAMA.key()
    assert random_model_dir("llama-tiny-random", tiny_dir.parents[1]) == tiny_dir
    with pytest.raises(ValueError, match="llama-3.2-1b-random"):
        random_model_dir("nope")
    assert set(MODEL_SPECS) == {
        "llama-3.2-1b-random",
        "llama-3.1-8b-8-layers-random",
        "qwen3-30b-a3b-4-layers-random",
        "llama-tiny-random",
        "qwen3-moe-tiny-random",
    }


def test_weights_are_seeded():
    a, b = random_weights(TINY_LLAMA, "cpu"), random_weights(TINY_LLAMA, "cpu")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = random_weights(dataclasses.replace(TINY_LLAMA, seed=1), "cpu")
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_transformers_and_kvbatch_load_it_and_decode_the_same_greedy_tokens(tiny_dir):
    from transformers import AutoModelForCausalLM

    from kvbatch.engine import LLM, SamplingParams

    prompts = [[5 + i for i in range(40)], [300 - i for i in range(23)]]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    llm = LLM(model=str(tiny_dir), device="cpu", kv_cache_bytes=1 << 22)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_build_into_a_given_folder(tmp_path):
    spec = dataclasses.replace(TINY_LLAMA, num_hidden_layers=1, vocab_size=64)
    folder = build_random_model(spec, tmp_path / "m")
    spec_json = json.loads((folder / "kvbatch-spec.json").read_text())
    assert spec_json["num_hidden_layers"] == 1 and spec_json["vocab_size"] == 64

"""The random-weight model builder: a config-built Llama or Qwen3 folder both engines load,
cached."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from kvbatch.bench.models import (
    GPT_OSS_20B_4_LAYERS,
    LLAMA_3_1_8B_8_LAYERS,
    LLAMA_3_2_1B,
    MODEL_SPECS,
    QWEN3_8B_8_LAYERS,
    QWEN3_30B_A3B_4_LAYERS,
    TINY_GPT_OSS,
    TINY_LLAMA,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
    build_random_model,
    random_model_dir,
    random_weights,
)
from kvbatch.engine.model.loader import load_model


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
        "qwen3-8b-8-layers-random",
        "qwen3-tiny-random",
        "gpt-oss-20b-4-layers-random",
        "gpt-oss-tiny-random",
    }


def test_gpt_oss_spec_draws_its_experts_packed(tmp_path):
    """The gpt-oss specs' experts are MXFP4 as published (never a float copy), with the
    mxfp4 quantization_config, and the engine loads them 4-bit."""
    assert GPT_OSS_20B_4_LAYERS.config().layer_types[:2] == ["sliding_attention", "full_attention"]
    folder = random_model_dir(TINY_GPT_OSS, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    weights = load_file(str(folder / "model.safetensors"))
    blocks = weights["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (8, 128, 2, 16)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in weights
    loaded = load_model(folder, torch.float32, torch.device("cpu"))
    assert loaded.quantization_method == "mxfp4"


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


# --- dense Qwen3 ---------------------------------------------------------------------------


def test_qwen3_8b_spec_is_qwen3_8b_s_config_with_8_layers():
    """Qwen3-8B's config.json, but for num_hidden_layers (36 there)."""
    from transformers import Qwen3Config

    config = QWEN3_8B_8_LAYERS.config()
    assert isinstance(config, Qwen3Config) and config.model_type == "qwen3"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        4096,
        12288,
        8,
    )
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert heads == (32, 8, 128)
    assert (config.vocab_size, config.max_position_embeddings) == (151936, 40960)
    assert config.tie_word_embeddings is False and config.attention_bias is False
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert QWEN3_8B_8_LAYERS.dtype == "bfloat16"


@pytest.mark.parametrize("spec", list(MODEL_SPECS.values()), ids=list(MODEL_SPECS))
def test_parameter_count_is_that_of_transformers_module_tree(spec):
    """Qwen3's q/k norms included (on the meta device: nothing is allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.config())
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())


def test_qwen3_8b_8_layers_is_2_8_b_parameters():
    assert round(QWEN3_8B_8_LAYERS.num_parameters() / 1e9, 2) == 2.79


def test_the_specs_made_before_the_architecture_field_keep_their_cache_keys():
    """A changed key would rebuild (and on the GPU machine, redraw and rewrite) their folders."""
    keys = {
        s.name: s.key()
        for s in (LLAMA_3_2_1B, LLAMA_3_1_8B_8_LAYERS, QWEN3_30B_A3B_4_LAYERS, TINY_LLAMA)
    }
    keys[TINY_QWEN3_MOE.name] = TINY_QWEN3_MOE.key()
    assert keys == {
        "llama-3.2-1b-random": "8ebcccfc2764",
        "llama-3.1-8b-8-layers-random": "87444563d4fd",
        "qwen3-30b-a3b-4-layers-random": "ae12c69d0664",
        "llama-tiny-random": "b938412fe66d",
        "qwen3-moe-tiny-random": "421cf8b98346",
    }
    assert TINY_QWEN3.key() != dataclasses.replace(TINY_QWEN3, architecture="llama").key()


def test_an_unknown_architecture_or_a_qwen3_with_experts_is_refused():
    with pytest.raises(ValueError, match="architecture must be one of llama, qwen3"):
        dataclasses.replace(TINY_LLAMA, architecture="gemma")
    with pytest.raises(ValueError, match="Qwen3-MoE already"):
        dataclasses.replace(TINY_QWEN3_MOE, architecture="qwen3")


def test_qwen3_folder_loads_as_our_qwen3_with_its_head_dim_and_q_k_norms(tmp_path):
    folder = random_model_dir(TINY_QWEN3, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen3"  # what the loader picks Qwen3ForCausalLM by
    assert config["head_dim"] == 32 != config["hidden_size"] // config["num_attention_heads"]
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" in weights  # untied
    assert torch.all(weights["model.layers.1.self_attn.k_norm.weight"] == 1)

    loaded = load_model(folder, torch.float32, torch.device("cpu"))
    assert loaded.config.architecture == "Qwen3ForCausalLM"
    assert loaded.config.qk_norm and loaded.config.head_dim == 32
    assert not loaded.config.qkv_bias and not loaded.config.tie_word_embeddings
    assert (loaded.config.rope.theta, loaded.config.rope.head_dim) == (1000000.0, 32)
    attention = loaded.model.model.layers[0].self_attn
    assert attention.q_proj.weight.shape == (4 * 32, 64)
    assert attention.k_proj.weight.shape == (2 * 32, 64)
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (32,)
    assert torch.equal(loaded.model.lm_head.weight, weights["lm_head.weight"])

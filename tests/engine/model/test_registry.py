"""engine/model/registry.py: the architecture files of engine/models/ register their names;
lookups by `architectures`, by model_type alone (GGUF configs) and by a base model's name."""

from __future__ import annotations

import pytest

import kvbatch.engine.models.phi3 as phi3
from kvbatch.engine.model.registry import (
    ARCHITECTURES,
    Architecture,
    architecture_named,
    register_architecture,
)
from kvbatch.engine.models.gemma import GemmaForCausalLM
from kvbatch.engine.models.llama import LlamaForCausalLM


def test_each_file_registers_its_architectures():
    assert ARCHITECTURES["Phi3ForCausalLM"].adapt_checkpoint is phi3.llama_names
    assert ARCHITECTURES["Gemma3ForCausalLM"].model_class is GemmaForCausalLM
    assert ARCHITECTURES["Qwen3MoeForCausalLM"].model_class is LlamaForCausalLM
    assert ARCHITECTURES["Qwen3ForCausalLM"].qk_norm
    assert not ARCHITECTURES["MistralForCausalLM"].attention_bias


def test_lookups_by_name_model_type_and_base_model():
    assert architecture_named(["Qwen2ForCausalLM"], "qwen2") == (
        ARCHITECTURES["Qwen2ForCausalLM"],
        True,
    )
    assert architecture_named([], "gemma3_text") == (ARCHITECTURES["Gemma3ForCausalLM"], True)
    assert architecture_named(["Qwen3Model"], "qwen3") == (ARCHITECTURES["Qwen3ForCausalLM"], False)
    assert architecture_named(["GPTNeoXForCausalLM"], "gpt_neox")[0] is None
    assert architecture_named([], "gpt_neox")[0] is None


def test_a_name_registered_twice_is_refused():
    with pytest.raises(ValueError, match="LlamaForCausalLM is registered twice"):
        register_architecture(Architecture("LlamaForCausalLM", "llama", LlamaForCausalLM))
    assert ARCHITECTURES["LlamaForCausalLM"].mlp_bias  # the file's registration stands

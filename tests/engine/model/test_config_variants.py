"""Config variants that released checkpoints use, against transformers in float32: each is a
tiny random model (2 to 4 layers, hidden 64) whose config.json is written the way the real
checkpoints write it (transformers 4 keys where they still ship them), and whose logits must
equal transformers' for a prompt longer than the RoPE scalings' pretraining length. RoPE YaRN
is also checked against transformers' own rope initialisation, parameter set by parameter set.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvbatch.engine.model.loader import load_model
from kvbatch.engine.model.rope import RopeConfig, inverse_frequencies
from kvbatch.engine.models.llama import ModelConfig
from tests.engine.core.test_llm import random_prompts
from tests.engine.model.test_architectures import load, with_config
from tests.engine.model.test_model import prefill_logits
from tests.reference import hf_logits
from tests.tiny_models import _SIZES, LLAMA3_ROPE, randomize_weights

ORIGINAL = 32  # the pretraining length of the scaled RoPEs below: the prompt passes it
PROMPT = random_prompts(512, (40,), seed=11)[0]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}


def _drop_rope_parameters(cfg: dict, **v4_keys) -> None:
    """Rewrite a saved config.json the transformers 4 way (rope_theta + rope_scaling ...)."""
    cfg.pop("rope_parameters", None)
    cfg.pop("layer_types", None)
    cfg.update(v4_keys)


VARIANTS: dict[str, tuple[Callable, Callable | None]] = {
    # Llama 3.2 as its config.json ships: tied embeddings, llama3 scaling in rope_scaling
    "llama3.2": (
        lambda: LlamaConfig(**{**_SIZES, "tie_word_embeddings": True}),
        lambda cfg: _drop_rope_parameters(
            cfg,
            rope_theta=500000.0,
            rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
        ),
    ),
    # Mistral-Nemo: head_dim 32 where hidden / heads is 16
    "mistral-nemo": (lambda: MistralConfig(**_SIZES, head_dim=32, sliding_window=None), None),
    # Qwen2.5: a sliding_window that use_sliding_window false switches off
    "qwen2-window-off": (
        lambda: Qwen2Config(**_SIZES, sliding_window=8, use_sliding_window=False),
        None,
    ),
    # Qwen3-MoE: experts on every second layer, the last listed dense, no renormalisation
    "qwen3-moe-sparse-step": (
        lambda: Qwen3MoeConfig(
            **{**_SIZES, "num_hidden_layers": 4},
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
        None,
    ),
    # Qwen2-MoE with qkv_bias off and renormalised top-k, beside its gated shared expert
    "qwen2-moe-no-qkv-bias": (
        lambda: Qwen2MoeConfig(
            **_SIZES,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            qkv_bias=False,
        ),
        None,
    ),
    # Phi-4-mini: partial rotary 0.75, LongRoPE short/long factors, tied embeddings
    "phi4-mini": (
        lambda: Phi3Config(
            **{**_SIZES, "tie_word_embeddings": True, "pad_token_id": 0},
            original_max_position_embeddings=ORIGINAL,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [1.0 + 1.5 * i for i in range(6)],
            },
        ),
        None,
    ),
    # Gemma 3 text as its config.json ships: linear factor 8 on the global layers,
    # rope_local_base_freq, and sliding_window_pattern instead of layer_types
    "gemma3-linear8": (
        lambda: Gemma3TextConfig(
            **{**_SIZES, "tie_word_embeddings": True, "pad_token_id": 0, "num_hidden_layers": 3},
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
        ),
        lambda cfg: _drop_rope_parameters(
            cfg,
            rope_theta=1e6,
            rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            sliding_window_pattern=3,
        ),
    ),
    # Gemma 3 with soft-caps set: transformers applies the final one and never reads the
    # attention one (Gemma 3 has q/k norms instead)
    "gemma3-softcaps": (
        lambda: Gemma3TextConfig(
            **{**_SIZES, "tie_word_embeddings": True, "pad_token_id": 0},
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=8.0,
        ),
        None,
    ),
    "llama-mlp-bias": (lambda: LlamaConfig(**_SIZES, mlp_bias=True), None),
    "llama-attention-bias": (lambda: LlamaConfig(**_SIZES, attention_bias=True), None),
    # Qwen3 long context (transformers 5 form)
    "qwen3-yarn": (
        lambda: Qwen3Config(
            **_SIZES,
            head_dim=32,
            rope_parameters={**YARN, "original_max_position_embeddings": ORIGINAL},
        ),
        None,
    ),
    # Qwen2.5 long context as its README says to write it (rope_scaling with "type")
    "qwen2.5-yarn": (
        lambda: Qwen2Config(**_SIZES, use_sliding_window=False),
        lambda cfg: _drop_rope_parameters(
            cfg,
            rope_theta=10000.0,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        ),
    ),
    # every YaRN knob: betas, mscale / mscale_all_dim, no truncation
    "llama-yarn-mscale": (
        lambda: LlamaConfig(
            **_SIZES,
            rope_parameters={
                **YARN,
                "factor": 8.0,
                "original_max_position_embeddings": ORIGINAL,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            },
        ),
        None,
    ),
}


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """`get(name) -> Path`: VARIANTS[name] saved with random weights (and its config.json
    rewritten as released checkpoints write it), built once per module."""
    root = tmp_path_factory.mktemp("variants")
    built = {}

    def get(name: str):
        if name not in built:
            make_config, rewrite = VARIANTS[name]
            model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32)
            randomize_weights(model, sorted(VARIANTS).index(name))
            model.save_pretrained(root / name)
            if rewrite is not None:
                cfg = json.loads((root / name / "config.json").read_text())
                rewrite(cfg)
                (root / name / "config.json").write_text(json.dumps(cfg))
            built[name] = root / name
        return built[name]

    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(variant, name):
    path = variant(name)
    model = load_model(path, torch.float32, torch.device("cpu")).model
    model.rotary.fit_context(len(PROMPT))  # LongRoPE: the long factors past 32 tokens
    ours = prefill_logits(model, PROMPT, 9)
    torch.testing.assert_close(ours, hf_logits(path, PROMPT), atol=1e-4, rtol=0)


def test_the_variants_read_what_they_change(variant):
    """The loaded configs carry the variants (a test above passing on a default would be
    vacuous)."""
    cfg = {name: load(variant(name)).config for name in ("qwen2-window-off", "gemma3-linear8")}
    assert cfg["qwen2-window-off"].sliding_window is None
    gemma = cfg["gemma3-linear8"]
    assert [gemma.is_sliding(i) for i in range(3)] == [True, True, False]
    assert gemma.rope.rope_type == "linear" and gemma.rope.scaling["factor"] == 8.0
    for name in ("qwen3-yarn", "qwen2.5-yarn"):
        rope = load(variant(name)).config.rope
        assert rope.rope_type == "yarn" and rope.attention_factor > 1.0


@pytest.mark.parametrize(
    "params",
    [
        dict(factor=4.0, original_max_position_embeddings=32768),  # Qwen2.5 / Qwen3
        dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
             mscale=1.0, mscale_all_dim=1.0),  # DeepSeek-style mscale (ratio 1)
        dict(factor=8.0, original_max_position_embeddings=64, mscale=0.707,
             mscale_all_dim=1.0, truncate=False),
        dict(factor=2.0, original_max_position_embeddings=128, attention_factor=1.25),
        dict(factor=None, original_max_position_embeddings=64),  # max_position_embeddings / 64
    ],
    ids=["qwen", "deepseek", "mscale-no-truncate", "attention-factor", "implicit-factor"],
)  # fmt: skip
def test_yarn_equals_transformers_rope_init(params):
    hf = LlamaConfig(
        **{**_SIZES, "max_position_embeddings": 512},
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, **params},
    )
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    rope = ModelConfig.from_hf(hf).rope
    torch.testing.assert_close(inverse_frequencies(rope), want_freq, atol=0, rtol=1e-6)
    assert rope.attention_factor == pytest.approx(want_factor, rel=1e-6)
    plain = inverse_frequencies(RopeConfig(head_dim=rope.head_dim, theta=1e6))
    assert not torch.equal(inverse_frequencies(rope), plain)


def test_dynamic_ntk_is_refused_with_the_reason(tiny_models, tmp_path):
    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    path = with_config(tiny_models("llama-gqa"), tmp_path / "m", rope_parameters=rope)
    with pytest.raises(ValueError, match="'dynamic' is not supported: transformers recomputes"):
        load(path)


def test_bias_tensors_the_config_does_not_announce_are_refused(variant, tmp_path):
    """mlp_bias left out of config.json would otherwise drop the weights' biases silently."""
    path = with_config(variant("llama-mlp-bias"), tmp_path / "m", mlp_bias=False)
    with pytest.raises(ValueError, match=r"bias tensors .*mlp\.down_proj\.bias"):
        load(path)


@pytest.mark.parametrize("arch", ["Phi3SmallForCausalLM", "Step3ForCausalLM"])
def test_an_architecture_outside_the_list_names_the_supported_ones(arch):
    hf = SimpleNamespace(architectures=[arch], model_type="x")
    with pytest.raises(ValueError, match=f"{arch} is not supported; supported: .*LlamaForCausalLM"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize(
    "arch, reason",
    [
        ("DeepseekV32ForCausalLM", "sparse attention .*lightning indexer"),
        ("KimiLinearForCausalLM", "KDA linear-attention layers"),
        ("DeepseekV2ForCausalLM", "DeepSeek-V2's routers"),
    ],
)
def test_mla_variants_are_refused_naming_what_is_missing(arch, reason):
    """MLA models whose other parts kvbatch lacks name that part (DeepSeek-V3 and Mistral 4
    themselves load: tests/engine/model/test_deepseek_v3.py, test_mistral4.py)."""
    hf = SimpleNamespace(architectures=[arch], model_type="x")
    with pytest.raises(ValueError, match=f"architecture {arch} is not supported: .*{reason}"):
        ModelConfig.from_hf(hf)


def test_mlp_bias_on_an_architecture_without_it_is_named(tiny_models, tmp_path):
    path = with_config(tiny_models("qwen3"), tmp_path / "m", mlp_bias=True)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM checkpoint uses mlp_bias"):
        load(path)


def test_layers_the_config_does_not_count_are_refused(tiny_models, tmp_path):
    """A config.json with fewer layers than its weights (edited, or another model's) would load
    the first layers and answer wrongly; the load names the layers left over."""
    src = tiny_models("llama-gqa")
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    path = with_config(src, tmp_path / "m", num_hidden_layers=layers - 1)
    with pytest.raises(ValueError, match=rf"tensors .*model\.layers\.{layers - 1}\..*num_hidden"):
        load(path)

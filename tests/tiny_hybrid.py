"""Tiny random hybrid linear-attention checkpoints (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) built
from transformers' own config classes, saved as real ones are (float32 safetensors), with the
weights drawn as tests/tiny_models.py draws them.

Four layers, three Gated DeltaNet and one gated full-attention (the published ratio), two key
heads shared by four value heads, a conv kernel of 4.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import Qwen3NextConfig

from tests.tiny_models import BOS, EOS, VOCAB_SIZE, WEIGHT_STD, randomize_weights

HYBRID_KINDS = ("qwen3-next", "qwen3.5", "qwen3.5-moe")

_SIZES = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=WEIGHT_STD,
    rms_norm_eps=1e-6,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


def tiny_hybrid_config(kind: str) -> PretrainedConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if kind == "qwen3-next":
        # decoder_sparse_step 1 with layer 2 dense (mlp_only_layers), top 2 renormalised
        return Qwen3NextConfig(
            **_SIZES, **_MOE, norm_topk_prob=True, mlp_only_layers=[2], rope_parameters=rope
        )
    if kind == "qwen3.5":
        return Qwen3_5TextConfig(
            **_SIZES,
            rope_parameters={**rope, "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        )
    if kind == "qwen3.5-moe":
        return Qwen3_5MoeTextConfig(
            **{k: v for k, v in _SIZES.items() if k != "intermediate_size"},
            **_MOE,
            rope_parameters={**rope, "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        )
    raise ValueError(f"unknown hybrid kind {kind!r}; expected one of {HYBRID_KINDS}")


def build_tiny_hybrid(kind: str, path: Path, seed: int = 0) -> Path:
    config = tiny_hybrid_config(kind)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed * 7 + HYBRID_KINDS.index(kind) + 100)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    model.save_pretrained(Path(path))
    return Path(path)


def build_tiny_qwen35_vision_language(path: Path, seed: int = 0, mtp: bool = True) -> Path:
    """A tiny Qwen3_5ForConditionalGeneration (the published Qwen3.5 checkpoints' class) with
    the tiny qwen3.5 text model and a one-block vision tower; `mtp` adds stand-in
    multi-token-prediction tensors as the published files carry."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5 import Qwen3_5Config

    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=64,
        patch_size=4,
        temporal_patch_size=2,
        spatial_merge_size=2,
    )
    config = Qwen3_5Config(
        text_config=tiny_hybrid_config("qwen3.5").to_dict(),
        vision_config=vision,
        tie_word_embeddings=False,
    )
    model = Qwen3_5ForConditionalGeneration(config)
    randomize_weights(model, seed * 7 + 99)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    path = Path(path)
    model.save_pretrained(path)
    if mtp:
        weights = load_file(path / "model.safetensors")
        weights["mtp.fc.weight"] = torch.zeros(64, 128)
        weights["mtp.norm.weight"] = torch.zeros(64)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path

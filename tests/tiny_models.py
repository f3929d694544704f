"""Tiny random checkpoints of the architectures the engine loads, saved the way real ones are.

Each kind is a Hugging Face folder (config.json, generation_config.json, float32 safetensors)
that transformers loads back, so a test can run the engine and transformers on the same file.
No tokenizer: prompts are token ids (vocabulary 512; 1 is BOS, 2 is EOS).

Random tiny models usually have near-tied logits, so a greedy token can flip on float rounding
between two correct implementations. The weights here are drawn larger than transformers' own
initialisation (std 0.1 rather than 0.02) to make greedy decoding decisive, and what
transformers would initialise to constants (RMSNorm weights to 1, biases to 0) is randomised
too, so that a loader which skips or misplaces those tensors changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GenerationConfig,
    GptOssConfig,
    LlamaConfig,
    Mistral4Config,
    Mistral4ForCausalLM,
    MistralConfig,
    MixtralConfig,
    Olmo3Config,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
)

from kvbatch.engine.quant.mxfp4_pack import pack_mxfp4_checkpoint

LLAMA_KINDS = ("llama-gqa", "llama-mha", "llama3-rope", "qwen2", "mistral", "llama-sharded")
"""The dense kinds with Llama's layer (no q/k norm, no experts)."""

MOE_KINDS = ("qwen3-moe", "mixtral", "qwen2-moe")
"""Mixture-of-experts kinds (see tiny_config for where their experts sit)."""

PHI3_KINDS = ("phi3",)
"""Phi-3 / Phi-4: fused qkv_proj and gate_up_proj on disk, LongRoPE, partial rotary."""

SLIDING_KINDS = ("mistral-window",)
"""Sliding-window attention on every layer (Mistral's `sliding_window`)."""

GEMMA_KINDS = ("gemma2", "gemma3")
"""Gemma's layer (engine/models/gemma.py), local and global layers alternating."""

DENSE_2026_KINDS = ("smollm3", "olmo3", "gemma4", "gemma4-dense")
"""The dense families of 2026, each its own file in engine/models/."""
GPT_OSS_KINDS = ("gpt-oss", "gpt-oss-mxfp4")
MLA_KINDS = ("deepseek-v3", "deepseek-v3-no-qlora", "mistral4")
"""Multi-head latent attention (engine/models/deepseek_v3.py, mistral4.py): "deepseek-v3" with
q_lora, a dense first layer, grouped sigmoid routing with a correction bias, a shared expert,
interleaved YaRN RoPE with mscale and an MTP layer in the file; "deepseek-v3-no-qlora" with
q_proj, every layer sparse, two shared experts, plain rotate-half RoPE; "mistral4" with softmax
routing and queries scaled by position past an original 32 positions."""
"""gpt-oss (engine/models/gpt_oss.py): sinks, alternating windows, YaRN, biased experts with the
clamped SwiGLU; "gpt-oss-mxfp4" is the same model with its experts written in MXFP4 as OpenAI
publishes them (transformers reads it back with Mxfp4Config(dequantize=True))."""

KINDS = (
    LLAMA_KINDS
    + ("qwen3",)
    + MOE_KINDS
    + PHI3_KINDS
    + SLIDING_KINDS
    + GEMMA_KINDS
    + DENSE_2026_KINDS
    + GPT_OSS_KINDS
    + MLA_KINDS
)
"""Every kind build_tiny_checkpoint knows."""

_SEED_SALT = {
    "llama-gqa": 0,
    "llama-sharded": 0,
    "llama-mha": 1,
    "llama3-rope": 2,
    "qwen2": 3,
    "mistral": 4,
    "qwen3": 5,
    "qwen3-moe": 6,
    "mixtral": 7,
    "qwen2-moe": 8,
    "phi3": 9,
    "mistral-window": 10,
    "gemma2": 11,
    "gemma3": 12,
    "smollm3": 13,
    "olmo3": 14,
    "gemma4": 15,
    "gemma4-dense": 16,
    "gpt-oss": 17,
    "gpt-oss-mxfp4": 17,
    "deepseek-v3": 18,
    "deepseek-v3-no-qlora": 19,
    "mistral4": 20,
}

VOCAB_SIZE = 512
BOS, EOS = 1, 2
WEIGHT_STD = 0.1

_SIZES = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=WEIGHT_STD,
    rms_norm_eps=1e-6,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
)

PHI3_ORIGINAL_CONTEXT = 64  # the tiny phi3's LongRoPE pretraining length
SLIDING_WINDOW = 24  # the tiny sliding-window kinds' window: shorter than the tests' prompts

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_config(kind: str) -> PretrainedConfig:
    """The transformers config of a tiny `kind` (see KINDS)."""
    if kind in ("llama-gqa", "llama-sharded"):
        return LlamaConfig(**_SIZES)
    if kind == "llama-mha":
        return LlamaConfig(**{**_SIZES, "num_key_value_heads": 4})
    if kind == "llama3-rope":
        # transformers 5 reads RoPE scaling from `rope_parameters` (it still accepts the old
        # `rope_scaling` + `rope_theta` keys of real Llama 3 config.json files).
        return LlamaConfig(**_SIZES, rope_parameters=dict(LLAMA3_ROPE))
    if kind == "qwen2":
        # Qwen2 always has q/k/v biases (no o_proj bias), and ties its embeddings.
        return Qwen2Config(**{**_SIZES, "tie_word_embeddings": True}, use_sliding_window=False)
    if kind == "mistral":
        return MistralConfig(**_SIZES, sliding_window=None)
    if kind == "qwen3":
        # head_dim from the config (32, not hidden / heads = 16), tied embeddings as Qwen3-0.6B.
        return Qwen3Config(**{**_SIZES, "tie_word_embeddings": True}, head_dim=32)
    if kind == "qwen3-moe":
        # 8 experts, top 2, renormalised; layer 1 is listed dense (mlp_only_layers).
        return Qwen3MoeConfig(
            **_SIZES,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if kind == "mixtral":
        # 4 experts of intermediate_size, top 2, always renormalised; every layer sparse.
        return MixtralConfig(**_SIZES, num_local_experts=4, num_experts_per_tok=2)
    if kind == "qwen2-moe":
        # Experts every second layer (decoder_sparse_step 2: layer 1 only), top 3 of 6 without
        # renormalisation, plus the gated shared expert.
        return Qwen2MoeConfig(
            **_SIZES,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            decoder_sparse_step=2,
        )
    if kind == "phi3":
        # Phi-4-mini's shape of RoPE: LongRoPE with short and long factors per rotated pair,
        # a partial rotary factor (12 of 16 dimensions), and a pretraining length (64) that
        # the tests' longer prompts pass.
        pairs = 6
        return Phi3Config(
            **{**_SIZES, "pad_token_id": 0},
            original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
                "long_factor": [1.0 + 1.5 * i for i in range(pairs)],
            },
        )
    if kind == "mistral-window":
        return MistralConfig(**_SIZES, sliding_window=SLIDING_WINDOW)
    if kind == "gemma2":
        # Soft-caps small enough to bend this tiny model's scores and logits (real Gemma 2:
        # 50 and 30), and a query scale that is not head_dim's.
        return Gemma2Config(
            **{**_SIZES, "tie_word_embeddings": True, "pad_token_id": 0},
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=SLIDING_WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=8.0,
            layer_types=["sliding_attention", "full_attention"],
        )
    if kind == "gemma3":
        # Three layers, local, local, global; the global layers' RoPE has a linear factor and a
        # base of its own, as Gemma 3's real ones.
        return Gemma3TextConfig(
            **{**_SIZES, "tie_word_embeddings": True, "pad_token_id": 0, "num_hidden_layers": 3},
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        )
    if kind == "smollm3":
        # Layers 1 and 3 are NoPE layers (no_rope_layer_interval 2: no_rope_layers [1, 0, 1,
        # 0], 1 = uses RoPE); use_sliding_window gives the NoPE layers the window, as
        # transformers' SmolLM3Config builds layer_types.
        return SmolLM3Config(
            **{**_SIZES, "num_hidden_layers": 4, "pad_token_id": 0},
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
        )
    if kind == "olmo3":
        # Three local layers and a global one (transformers' default pattern), the global
        # layers' RoPE YaRN-scaled past a 64-token pretraining length on a base of their own,
        # q/k/v/o biases.
        return Olmo3Config(
            **{**_SIZES, "num_hidden_layers": 4, "max_position_embeddings": 256},
            sliding_window=SLIDING_WINDOW,
            attention_bias=True,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            },
        )
    if kind in ("gemma4", "gemma4-dense"):
        return gemma4_config(full=kind == "gemma4")
    if kind in GPT_OSS_KINDS:
        # 4 experts (intermediate 32: MXFP4 groups of 32 along both projections), top 2;
        # sliding and full layers alternating; YaRN over an original 32 positions (prompts go
        # past it), truncate false as gpt-oss's config; a SwiGLU limit small enough that this
        # model's gate and up values reach it.
        return GptOssConfig(
            **{**_SIZES, "num_hidden_layers": 3, "intermediate_size": 32, "pad_token_id": 0},
            head_dim=24,  # heads x head_dim (96) is not hidden (64), as in gpt-oss
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            swiglu_limit=0.6,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 16.0,  # max_position_embeddings / original, as transformers expects
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
            },
        )
    if kind in MLA_KINDS:
        return mla_config(kind)
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(KINDS)}")


_MLA_SIZES = dict(
    **{**_SIZES, "num_key_value_heads": 4, "intermediate_size": 96},
    moe_intermediate_size=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=24,
    num_experts_per_tok=2,
)


def mla_config(kind: str) -> PretrainedConfig:
    """The tiny MLA kinds (MLA_KINDS says what each switches on)."""
    if kind == "deepseek-v3":
        return DeepseekV3Config(
            **{**_MLA_SIZES, "num_hidden_layers": 3},
            q_lora_rank=48,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            rope_interleave=True,
            num_nextn_predict_layers=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.8,
                "mscale_all_dim": 1.0,
            },
        )
    if kind == "deepseek-v3-no-qlora":
        return DeepseekV3Config(
            **_MLA_SIZES,
            q_lora_rank=None,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            n_shared_experts=2,
            first_k_dense_replace=0,
            rope_interleave=False,
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            num_nextn_predict_layers=0,
        )
    return Mistral4Config(
        **{**_MLA_SIZES, "pad_token_id": 0},
        q_lora_rank=48,
        n_routed_experts=4,
        n_shared_experts=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
            "partial_rotary_factor": 8 / 24,
        },
    )


def gemma4_config(full: bool) -> Gemma4TextConfig:
    """Six layers, local, local, global, twice; the local layers with head_dim 16 and one KV
    head, the global ones with head_dim 32: caches of two shapes, a slot's blocks strided. Per-layer inputs of 8, a final soft-cap. `full`: the
    last two layers share the KV of layers 3 and 2 (with double-wide MLPs), the global layers'
    V is their K (attention_k_eq_v), and every layer has the MoE block beside its MLP."""
    extra = dict(
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    )
    return Gemma4TextConfig(
        **{
            **_SIZES,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "num_hidden_layers": 6,
            "num_key_value_heads": 1,
        },
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB_SIZE,
        final_logit_softcapping=8.0,
        **(extra if full else {}),
    )


def build_tiny_checkpoint(kind: str, path: Path, seed: int = 0, **config_overrides) -> Path:
    """Save a tiny random `kind` checkpoint (float32 safetensors) into `path`; return `path`.
    `config_overrides` replace fields of its config (e.g. a long max_position_embeddings).

    The weights depend only on `kind` and `seed`; "llama-sharded" is llama-gqa (same weights)
    saved in several shards with a model.safetensors.index.json.
    """
    config = tiny_config(kind)
    for name, value in config_overrides.items():
        setattr(config, name, value)
    if kind == "mistral4":  # transformers' AutoModelForCausalLM does not map mistral4
        model = Mistral4ForCausalLM(config).to(torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Kinds with the same tensor names and shapes (llama-gqa, llama3-rope, mistral) would
    # otherwise get the same weights; llama-sharded keeps llama-gqa's on purpose.
    randomize_weights(model, seed * len(KINDS) + _SEED_SALT[kind])
    with torch.no_grad():  # Gemma 4's per-layer output scale is a buffer, saved with the weights
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.fill_(0.5 + 0.1 * int(name.split(".")[2]))
    if kind in GPT_OSS_KINDS:
        with torch.no_grad():  # sinks large enough to take a real share of the softmax
            for layer in model.model.layers:
                layer.self_attn.sinks.mul_(20.0)
    if kind in MLA_KINDS:
        with torch.no_grad():  # a bias large enough to change which experts are chosen
            g = torch.Generator().manual_seed(seed)
            for name, buffer in sorted(model.named_buffers()):
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.3 * torch.randn(buffer.shape, generator=g))
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    path = Path(path)
    shard = "100KB" if kind == "llama-sharded" else "1GB"
    model.save_pretrained(path, max_shard_size=shard)
    if kind == "gpt-oss-mxfp4":
        write_mxfp4_experts(path)
    if getattr(config, "num_nextn_predict_layers", 0):
        write_mtp_layer(path, config.num_hidden_layers)
    return path


def write_mtp_layer(path: Path, index: int) -> None:
    """Add a multi-token-prediction layer `model.layers.{index}.*` to a saved DeepSeek-V3
    folder, as DeepSeek publishes it (a decoder layer plus its eh_proj, enorm, hnorm and
    shared_head): transformers ignores it, and so must the engine."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    last = f"model.layers.{index - 1}."
    for name in [k for k in tensors if k.startswith(last)]:
        tensors[f"model.layers.{index}." + name[len(last) :]] = tensors[name].clone()
    hidden = tensors["model.norm.weight"].shape[0]
    for extra, shape in (
        ("eh_proj.weight", (hidden, 2 * hidden)),
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("shared_head.norm.weight", (hidden,)),
    ):
        tensors[f"model.layers.{index}.{extra}"] = torch.ones(shape)
    save_file(tensors, file, metadata={"format": "pt"})


def write_mxfp4_experts(path: Path) -> None:
    """Rewrite a saved gpt-oss folder's experts in MXFP4, as OpenAI publishes them."""
    pack_mxfp4_checkpoint(path, path)


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from a generator seeded with `seed`, in name order.

    Norm weights become 1 + 0.1 * N(0, 1), biases 0.1 * N(0, 1), and every other weight
    0.1 * N(0, 1). Tied parameters are drawn once (named_parameters lists each tensor once).
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if "norm" in name.rsplit(".", 2)[-2]:
            p.copy_(1.0 + WEIGHT_STD * noise)
        else:
            p.copy_(WEIGHT_STD * noise)


CHAT_VOCAB_SIZE = 49152  # SmolLM2's tokenizer
TOKENIZER_COPY = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_chat_checkpoint(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random Llama (hidden 64, 2 layers) with SmolLM2's vocabulary, tokenizer and chat
    template copied from `tokenizer_dir`: jobs need a real tokenizer, and this model answers in
    milliseconds. BOS 1 and EOS 2, as SmolLM2's."""
    import shutil

    config = LlamaConfig(
        **{**_SIZES, "vocab_size": CHAT_VOCAB_SIZE, "max_position_embeddings": 2048}
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    path = Path(path)
    model.save_pretrained(path)
    for name in TOKENIZER_COPY:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path

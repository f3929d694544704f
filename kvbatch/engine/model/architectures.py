"""Which checkpoints the engine runs, and the features of their configs it does not have.

A config names its architecture (`architectures`, or only `model_type` in GGUF-derived
configs). An architecture outside SUPPORTED_ARCHITECTURES fails with the list; a supported one
whose config switches on something the forward pass lacks (a vision tower, an activation the
MLP does not run, biases where its modules have none) fails naming that feature, rather than
loading and answering wrongly. Sliding-window layers are supported (engine/attention/
layer_spec.py). RoPE scaling types (default, linear, llama3, longrope, yarn; dynamic refused)
are checked in rope.py.
"""

from __future__ import annotations

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)

ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
"""For configs without `architectures` (those transformers reads from GGUF files)."""

BASE_MODEL_ARCHITECTURES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}
"""The same transformers without their language-model head, as sentence-transformers saves an
embedding model: weights named without the "model." prefix, and no lm_head (embeddings only)."""

ENCODER_ARCHITECTURES = ("BertModel", "XLMRobertaModel", "RobertaModel")
"""Bidirectional encoders (engine/model/bert.py), run for embeddings only by the encoder engine
(engine/encoder/): no KV cache, no generation."""

ROBERTA_ARCHITECTURES = ("XLMRobertaModel", "RobertaModel")
"""Encoders that number positions as fairseq does (transformers' create_position_ids_from_
input_ids): from pad_token_id + 1, counting only tokens that are not the pad token, so the
first pad_token_id + 1 rows of the position table are never an input's (514 rows, pad 1:
inputs of up to 512 tokens)."""

ROBERTA_DEFAULT_PAD_TOKEN_ID = 1
"""transformers' RobertaConfig / XLMRobertaConfig default, for a config.json without it."""


def encoder_max_input_length(
    architecture: str, max_position_embeddings: int, pad_token_id: int | None
) -> int:
    """The longest input an encoder's position table holds: max_position_embeddings, less
    pad_token_id + 1 for the RoBERTa family (whose positions start after the pad id)."""
    if architecture not in ROBERTA_ARCHITECTURES:
        return max_position_embeddings
    pad = ROBERTA_DEFAULT_PAD_TOKEN_ID if pad_token_id is None else pad_token_id
    return max_position_embeddings - pad - 1


GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
"""engine/model/gemma.py's forward: GeGLU, (1 + w) norms around both sublayers, soft-caps."""

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
"""The names of the tanh-approximate GELU that Gemma's MLP runs."""

QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""RMSNorm over each head of q and k before RoPE."""

ATTENTION_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
"""Those whose `attention_bias` puts biases on q, k, v and o_proj (transformers' modules read
it); the other architectures' modules ignore the key, Gemma's included, so it is refused there
rather than guessed."""

MLP_BIAS_ARCHITECTURES = ("LlamaForCausalLM",)
"""Those whose `mlp_bias` puts biases on gate, up and down (only Llama's MLP reads it)."""

_MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower", "visual")


def check_supported_features(architecture: str, hf_config) -> None:
    """Raise ValueError naming the first feature of `hf_config` the engine cannot run."""
    for problem in _unsupported_features(architecture, hf_config):
        raise ValueError(f"{architecture} checkpoint uses {problem}")


def _unsupported_features(architecture: str, hf_config):
    for key in _MULTIMODAL_KEYS:
        if getattr(hf_config, key, None):
            yield (
                f"a vision or audio tower ({key} in config.json), which is not supported: "
                "kvbatch runs text-only models; use the text-only checkpoint"
            )
    if architecture in GEMMA_ARCHITECTURES:
        act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in GEMMA_ACTIVATIONS:
            yield (
                f"hidden_activation {act!r}, which is not supported: kvbatch's Gemma MLP is "
                "GeGLU with the tanh-approximate GELU (gelu_pytorch_tanh)"
            )
        act = "silu"  # hidden_act, where a Gemma config also has it, is the same GELU
    else:
        act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        yield (
            f"hidden_act {act!r}, which is not supported: kvbatch's MLP is SwiGLU (silu); "
            "set hidden_act to silu only if the checkpoint really uses it"
        )
    if bool(getattr(hf_config, "attention_bias", False)):
        if architecture not in ATTENTION_BIAS_ARCHITECTURES:
            yield (
                "attention_bias (biases on q/k/v and o_proj), which is not supported for "
                f"{architecture} (supported for {', '.join(ATTENTION_BIAS_ARCHITECTURES)})"
            )
    if bool(getattr(hf_config, "mlp_bias", False)) and architecture not in MLP_BIAS_ARCHITECTURES:
        yield f"mlp_bias (biases on the MLP's projections), which is not supported for {architecture}"

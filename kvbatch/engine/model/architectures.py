"""The features of a config the engine does not have, and the encoders' names.

A config names its architecture (`architectures`, or only `model_type` in GGUF-derived
configs); the decoders are registered by their own files (engine/model/registry.py). An
unregistered one fails with the list; a registered one whose config switches on something its
modules lack (a vision tower, an activation the MLP does not run, biases where its modules
have none) fails naming that feature, rather than loading and answering wrongly.
Sliding-window layers are supported (engine/attention/layer_spec.py). RoPE scaling types (default, linear, llama3, longrope, yarn; dynamic refused)
are checked in rope.py.
"""

from __future__ import annotations

from kvbatch.engine.model.registry import Architecture

REFUSED_ARCHITECTURES = {
    "DeepseekV32ForCausalLM": (
        "DeepSeek-V3.2's sparse attention (its lightning indexer picks the keys each query "
        "reads) is not supported; kvbatch runs DeepSeek-V3's dense MLA "
        "(DeepseekV3ForCausalLM)"
    ),
    "GlmMoeDsaForCausalLM": (
        "its DeepSeek sparse attention (an indexer picking the keys each query reads) is not "
        "supported; kvbatch runs dense MLA (DeepseekV3ForCausalLM, Mistral4ForCausalLM)"
    ),
    "KimiLinearForCausalLM": (
        "Kimi Linear's KDA linear-attention layers are not supported (its MLA layers would "
        "be, but not the model without the others)"
    ),
    "DeepseekV2ForCausalLM": (
        "DeepSeek-V2's routers (greedy and group-limited softmax top-k) are not implemented; "
        "its MLA is DeepSeek-V3's, so DeepSeek-V3-family checkpoints run"
    ),
}
"""Architectures close to a supported one, refused with what they have that kvbatch lacks."""

CROSS_ENCODER_ARCHITECTURES = (
    "BertForSequenceClassification",
    "XLMRobertaForSequenceClassification",
    "RobertaForSequenceClassification",
)
"""Encoders with a sequence-classification head (engine/model/sequence_classifier.py): the
cross-encoders that score (query, passage) pairs, run by the encoder engine's score path."""

ENCODER_ARCHITECTURES = (
    "BertModel",
    "XLMRobertaModel",
    "RobertaModel",
    *CROSS_ENCODER_ARCHITECTURES,
)
"""Bidirectional encoders (engine/model/bert.py), run by the encoder engine (engine/encoder/):
embeddings, or scores for the cross-encoders; no KV cache, no generation."""

ROBERTA_ARCHITECTURES = (
    "XLMRobertaModel",
    "RobertaModel",
    "XLMRobertaForSequenceClassification",
    "RobertaForSequenceClassification",
)
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


_MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower", "visual")


def check_supported_features(architecture: Architecture, hf_config) -> None:
    """Raise ValueError naming the first feature of `hf_config` the engine cannot run."""
    for problem in _unsupported_features(architecture, hf_config):
        raise ValueError(f"{architecture.name} checkpoint uses {problem}")


def _unsupported_features(arch: Architecture, hf_config):
    for key in _MULTIMODAL_KEYS:
        if getattr(hf_config, key, None):
            yield (
                f"a vision or audio tower ({key} in config.json), which is not supported: "
                "kvbatch runs text-only models; use the text-only checkpoint"
            )
    act = getattr(hf_config, arch.activation_key, None) or arch.activations[0]
    if act not in arch.activations:
        yield (
            f"{arch.activation_key} {act!r}, which is not supported: {arch.name}'s MLP runs "
            f"{' / '.join(arch.activations)}; set {arch.activation_key} to it only if the "
            "checkpoint really uses it"
        )
    if bool(getattr(hf_config, "attention_bias", False)) and not arch.attention_bias:
        yield (
            "attention_bias (biases on q/k/v and o_proj), which is not supported for "
            f"{arch.name} (its modules have none)"
        )
    if bool(getattr(hf_config, "mlp_bias", False)) and not arch.mlp_bias:
        yield f"mlp_bias (biases on the MLP's projections), which is not supported for {arch.name}"

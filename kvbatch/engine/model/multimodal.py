"""The language model inside a vision-language checkpoint, for text-only jobs.

Many of the models teams run are released only as vision-language checkpoints: Gemma 3 4B,
12B and 27B (Gemma3ForConditionalGeneration) and Mistral Small 3.1 / 3.2
(Mistral3ForConditionalGeneration) wrap a text model the engine runs (Gemma 3, Mistral) with a
vision tower and a projector. On a text-only prompt the tower never runs and the text model's
forward is the whole model's, so the engine loads the text model alone: its config is the
checkpoint's `text_config`, its weights are those under the language model's prefix, and the
tower's and projector's weights are left unread. Image inputs are refused line by line by the
job's validation (content parts other than text).

Two layouts of the same weights are in use: the one the models were published with
(`language_model.model.layers.0...`, `language_model.lm_head.weight`, `vision_tower.*`) and the
one transformers 5 saves (`model.language_model.layers.0...`, `lm_head.weight`,
`model.vision_tower.*`); both map to the engine's `model.*` names.
"""

from __future__ import annotations

import copy
import logging

import torch

log = logging.getLogger(__name__)

TEXT_MODEL_OF = {
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
    "Gemma4ForConditionalGeneration": "Gemma4ForCausalLM",
}
"""Vision-language architectures whose text model the engine runs, and that model's name."""

TEXT_MODEL_OF_TYPE = {"mistral4": "Mistral4ForCausalLM"}
"""Text configs whose model type names another text model than the wrapper's usual one:
Mistral Small 4 is a Mistral3ForConditionalGeneration around a Mistral 4 (MLA) text model."""

# (checkpoint prefix, engine prefix), first match wins
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "model.visual.",  # Qwen3.5's
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
    "model.audio_tower.",  # Gemma 4: the audio tower and both towers' embedders
    "model.embed_vision.",
    "model.embed_audio.",
)


def language_model_config(hf_config):
    """(the text model's config, True) for a supported vision-language config, else
    (hf_config, False). The text config keeps the wrapper's token ids where it has none."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    wrapper = next((a for a in archs if a in TEXT_MODEL_OF), None)
    if wrapper is None:
        return hf_config, False
    text = copy.deepcopy(hf_config.get_text_config())
    text_model = TEXT_MODEL_OF_TYPE.get(getattr(text, "model_type", ""), TEXT_MODEL_OF[wrapper])
    text.architectures = [text_model]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None and getattr(hf_config, key, None) is not None:
            setattr(text, key, getattr(hf_config, key))
    if getattr(hf_config, "tie_word_embeddings", None) is not None:
        text.tie_word_embeddings = hf_config.tie_word_embeddings
    log.info(
        "%s: loading its text model (%s) for text prompts; the vision tower is not loaded "
        "and image inputs are refused",
        wrapper,
        text_model,
    )
    return text, True


def language_model_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text model's tensors under the engine's names; the vision tower's and projector's
    dropped. A tensor under neither is kept as it is, for the loader to name if unexpected."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, engine in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = engine + name[len(prefix) :]
                break
        out[name] = tensor
    return out

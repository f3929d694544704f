"""The decoder architectures the engine runs, each registered by its own file.

An architecture file (engine/models/*.py) calls `register_architecture` once per Hugging Face
name it serves, with the module class to build and the config switches its modules read;
engine/models/__init__.py imports every file of that folder, so adding an architecture is
adding one file there (docs/ENGINE.md, "Adding an architecture"). The loader and
ModelConfig.from_hf look names up here; nothing else lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

CheckpointAdapter = Callable[[dict[str, torch.Tensor], object], dict[str, torch.Tensor]]
"""(state dict with the checkpoint's names, ModelConfig) -> state dict with the engine's."""


@dataclass(frozen=True)
class Architecture:
    """One `architectures` name of config.json and what the engine needs to run it."""

    name: str  # "Qwen3ForCausalLM"
    model_type: str  # config.json's model_type: GGUF-derived configs name only this
    model_class: Callable[..., nn.Module]  # built from a ModelConfig (on the meta device)
    base_model: str | None = None  # the name without the LM head ("Qwen3Model"): embeddings
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    attention_bias: bool = False  # reads `attention_bias`: biases on q, k, v and o_proj
    mlp_bias: bool = False  # reads `mlp_bias`: biases on gate, up and down
    activations: tuple[str, ...] = ("silu",)  # the hidden_act names its MLP runs
    activation_key: str = "hidden_act"  # the config key naming it (Gemma: hidden_activation)
    adapt_checkpoint: CheckpointAdapter | None = None  # renames or splits tensors at load
    # config.json's switch for `sliding_window` (SmolLM3: use_sliding_window); None: a window
    # in the config is always used
    sliding_window_switch: str | None = None
    # (transformers config, ModelConfig's fields so far) -> the family's own settings, kept in
    # ModelConfig.family for its model file (SmolLM3's NoPE layers, Gemma 4's shapes)
    read_family_config: Callable[[object, dict], object] | None = None
    # config.json's per_layer_config gives some layers another shape (Gemma 4): its global
    # head_dim and KV heads are then the other layers', and the family config reads the rest
    per_layer_shapes: bool = False


ARCHITECTURES: dict[str, Architecture] = {}


def register_architecture(architecture: Architecture) -> Architecture:
    """Add `architecture`; a name registered twice is a mistake in the architecture files."""
    if architecture.name in ARCHITECTURES:
        raise ValueError(f"architecture {architecture.name} is registered twice")
    ARCHITECTURES[architecture.name] = architecture
    return architecture


def supported_architectures() -> tuple[str, ...]:
    """Every registered name, with the LM head, then the base models'."""
    heads = tuple(ARCHITECTURES)
    return heads + tuple(a.base_model for a in ARCHITECTURES.values() if a.base_model)


def architecture_named(archs: list[str], model_type: str) -> tuple[Architecture | None, bool]:
    """The registered architecture of a config's `architectures` (or, where it has none, its
    model_type), and whether the checkpoint has an LM head (False for a base model)."""
    for name in archs:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name], True
    if not archs:
        found = [a for a in ARCHITECTURES.values() if a.model_type == model_type]
        return (found[0], True) if found else (None, True)
    for name in archs:
        for a in ARCHITECTURES.values():
            if a.base_model == name:
                return a, False
    return None, True

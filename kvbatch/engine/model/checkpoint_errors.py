"""Reading a checkpoint's files so that every way they can be broken is one line naming the
file and the problem (a CheckpointError), never a traceback from safetensors, json,
tokenizers or torch's load_state_dict.

The loader (engine/model/loader.py) reads config.json, generation_config.json, the index and
the safetensors shards through these helpers, checks config values the forward would turn
into NaN, and checks each weight's shape against the one config.json implies before any
tensor is adopted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

CONFIG = "config.json"

# What in config.json sets a weight's shape, by a piece of the weight's name.
_SHAPE_FIELDS = (
    (("embed_tokens", "lm_head"), "vocab_size and hidden_size"),
    (("q_norm", "k_norm"), "head_dim"),
    (
        ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"),
        "hidden_size, num_attention_heads, num_key_value_heads and head_dim",
    ),
    (
        ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "experts"),
        "hidden_size and intermediate_size",
    ),
)
_POSITIVE_EPS = ("rms_norm_eps", "layer_norm_eps")


class ShapeMismatch(ValueError):
    """A weight whose shape is not the one config.json implies (config.json is named)."""


class CheckpointError(ValueError):
    """A checkpoint file the engine cannot use: its message is one line, the file first."""

    def __init__(self, file: str | Path, problem: str) -> None:
        self.file = str(file)
        super().__init__(f"{file}: {' '.join(problem.split())}")


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; a CheckpointError naming it when it is no JSON object."""
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise CheckpointError(path, f"is not valid JSON ({e}): fix or replace the file") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot be read ({e.strerror or e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(
            path, f"holds a JSON {_json_kind(value)}, not an object: fix or replace the file"
        )
    return value


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def read_safetensors(files: Sequence[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of `files`; a CheckpointError names a file that is not a readable
    safetensors file (truncated, a header that lies about its length, shapes or offsets the
    data does not hold), or a tensor that two files both hold."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    source: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            what = "a folder" if f.is_dir() else "missing"
            raise CheckpointError(
                f,
                f"is {what}, not a safetensors file: the weights must be files named *.safetensors",
            )
        try:
            loaded = load_file(str(f))
        except Exception as e:  # safetensors' SafetensorError, OSError, ...
            raise CheckpointError(
                f,
                f"is not a readable safetensors file ({e}): it is truncated or damaged; "
                "download it again",
            ) from None
        for name, tensor in loaded.items():
            if name in tensors:
                raise CheckpointError(
                    f,
                    f"holds tensor {name!r}, which {source[name].name} holds too: a tensor "
                    "belongs to one shard; remove the duplicate file or fix the index",
                )
            tensors[name], source[name] = tensor, f
    return tensors


def check_config_values(hf_config: Any, config_file: Path) -> None:
    """Values of config.json the forward would silently turn into NaN or nonsense."""
    for name in _POSITIVE_EPS:
        eps = getattr(hf_config, name, None)
        if eps is None:
            continue
        if not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
            raise CheckpointError(
                config_file,
                f"{name} is {eps!r}: it must be a small positive number (1e-5 or 1e-6 as a rule)",
            )


def check_shapes(
    weights: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], config: Any
) -> None:
    """Each weight has the shape the model built from config.json expects (a ShapeMismatch
    whose message names the tensor, both shapes and the config fields that set it; the loader
    prefixes config.json's path)."""
    for name in sorted(expected):
        want = expected[name]
        have = weights.get(name)
        if have is None or tuple(have.shape) == tuple(want.shape):
            continue
        fields = next(
            (f for pieces, f in _SHAPE_FIELDS if any(p in name for p in pieces)), "hidden_size"
        )
        values = ", ".join(
            f"{f}={getattr(config, f)}"
            for f in ("vocab_size", "hidden_size", "head_dim", "intermediate_size")
            if getattr(config, f, None) is not None
        )
        raise ShapeMismatch(
            f"does not match the weights: tensor {name!r} has shape {list(have.shape)}, but "
            f"config.json ({values}) makes it {list(want.shape)}; check {fields} in config.json"
        )

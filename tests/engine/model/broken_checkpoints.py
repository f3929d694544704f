"""Broken checkpoints, each made from a tiny valid one (tests/tiny_models.py) by one change:
what a hostile or unlucky user hands the loader. Each maker changes the folder in place and
returns what the error must name (a file name, and a word of the problem)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return size, json.loads(raw[8 : 8 + size]), raw[8 + size :]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def truncated(folder: Path) -> tuple[str, str]:
    f = folder / WEIGHTS
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return WEIGHTS, "safetensors"


def header_only(folder: Path) -> tuple[str, str]:
    size, header, _ = _header(folder / WEIGHTS)
    (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[: 8 + size])
    return WEIGHTS, "safetensors"


def huge_header_length(folder: Path) -> tuple[str, str]:
    f = folder / WEIGHTS
    f.write_bytes(struct.pack("<Q", 2**60) + f.read_bytes()[8:])
    return WEIGHTS, "safetensors"


def wrong_shape(folder: Path) -> tuple[str, str]:
    _, header, data = _header(folder / WEIGHTS)
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)
    rows, cols = header[name]["shape"]
    header[name]["shape"] = [rows * 2, cols]  # the offsets now hold half the data it says
    _write_header(folder / WEIGHTS, header, data)
    return WEIGHTS, "safetensors"


def wrong_offsets(folder: Path) -> tuple[str, str]:
    _, header, data = _header(folder / WEIGHTS)
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + len(data)]
    _write_header(folder / WEIGHTS, header, data)
    return WEIGHTS, "safetensors"


def duplicate_tensor(folder: Path) -> tuple[str, str]:
    """One tensor in both shards of an index."""
    tensors = load_file(str(folder / WEIGHTS))
    name = next(iter(tensors))
    (folder / WEIGHTS).unlink()
    save_file(tensors, str(folder / "model-00001-of-00002.safetensors"))
    save_file({name: tensors[name]}, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors}
    weight_map[name] = "model-00002-of-00002.safetensors"  # both shards are read
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return "model-00002-of-00002.safetensors", name


def missing_tensor(folder: Path) -> tuple[str, str]:
    tensors = load_file(str(folder / WEIGHTS))
    name = next(k for k in tensors if "layers.1." in k)
    del tensors[name]
    save_file(tensors, str(folder / WEIGHTS))
    return str(folder), name


def vocab_mismatch(folder: Path) -> tuple[str, str]:
    _edit_config(folder, vocab_size=600)
    return "config.json", "vocab_size"


def head_dim_mismatch(folder: Path) -> tuple[str, str]:
    _edit_config(folder, head_dim=32)
    return "config.json", "head_dim"


def hidden_size_mismatch(folder: Path) -> tuple[str, str]:
    _edit_config(folder, hidden_size=96)
    return "config.json", "hidden_size"


def negative_rms_norm_eps(folder: Path) -> tuple[str, str]:
    _edit_config(folder, rms_norm_eps=-1.0)
    return "config.json", "rms_norm_eps"


def config_is_a_list(folder: Path) -> tuple[str, str]:
    (folder / "config.json").write_text(
        json.dumps([json.loads((folder / "config.json").read_text())])
    )
    return "config.json", "list"


def config_not_json(folder: Path) -> tuple[str, str]:
    (folder / "config.json").write_text("")
    return "config.json", "JSON"


def generation_config_not_json(folder: Path) -> tuple[str, str]:
    (folder / "generation_config.json").write_text("{eos_token_id: 2")
    return "generation_config.json", "JSON"


def tokenizer_without_keys(folder: Path) -> tuple[str, str]:
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    return "tokenizer.json", "tokenizer"


def folder_named_like_weights(folder: Path) -> tuple[str, str]:
    tensors = load_file(str(folder / WEIGHTS))
    (folder / WEIGHTS).unlink()
    (folder / WEIGHTS).mkdir()
    save_file(tensors, str(folder / "model-00001-of-00001.safetensors"))
    return WEIGHTS, "folder"


BREAKAGES: dict[str, Callable[[Path], tuple[str, str]]] = {
    f.__name__: f
    for f in (
        truncated,
        header_only,
        huge_header_length,
        wrong_shape,
        wrong_offsets,
        duplicate_tensor,
        missing_tensor,
        vocab_mismatch,
        head_dim_mismatch,
        hidden_size_mismatch,
        negative_rms_norm_eps,
        config_is_a_list,
        config_not_json,
        generation_config_not_json,
        tokenizer_without_keys,
        folder_named_like_weights,
    )
}
"""The 16 kinds, by name."""

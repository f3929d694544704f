"""How a checkpoint turns its final hidden states into one vector: read from its
sentence-transformers files.

A sentence-transformers folder lists its pipeline in modules.json:

    [{"idx": 0, "path": "",           "type": "sentence_transformers.models.Transformer"},
     {"idx": 1, "path": "1_Pooling",  "type": "sentence_transformers.models.Pooling"},
     {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]

and the Pooling module's config.json names the mode (`"pooling_mode": "lasttoken"`; before
version 6, one `pooling_mode_*` flag set to true). A checkpoint without
these files is taken for a decoder embedding model (Qwen3-Embedding, gte-Qwen2, e5-mistral):
the last token's state, normalised, which is what those models are trained to produce.
Anything the engine cannot reproduce exactly (max pooling, a Dense projection, several modes
at once) is refused by name rather than approximated.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path


class PoolingMethod(enum.Enum):
    LAST = "last"  # the last token's state: decoder models (it has seen the whole input)
    MEAN = "mean"  # the mean over every token of the input
    CLS = "cls"  # the first token's state


@dataclass(frozen=True)
class PoolingConfig:
    """What the pooler computes: one method, then an optional L2 normalisation."""

    method: PoolingMethod = PoolingMethod.LAST
    normalize: bool = True

    @property
    def needs_every_token(self) -> bool:
        """Whether the pooled vector reads hidden states before the last token's: such a
        request cannot start from a prefix cache hit (the cache keeps KV, not hidden states)."""
        return self.method is not PoolingMethod.LAST


DECODER_DEFAULT = PoolingConfig(PoolingMethod.LAST, normalize=True)
"""For a checkpoint without sentence-transformers files."""

# sentence-transformers 6 writes its Pooling settings as `pooling_mode` (a name, or a list of
# names to concatenate); earlier versions as one `pooling_mode_*` flag each.
_MODES = {
    "lasttoken": PoolingMethod.LAST,
    "mean": PoolingMethod.MEAN,
    "cls": PoolingMethod.CLS,
}
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def read_pooling_config(model_path: str | Path) -> PoolingConfig:
    """The pooling of the checkpoint at `model_path` (a folder, or a .gguf file whose folder
    is read); DECODER_DEFAULT when it has no modules.json. Raises ValueError naming the module
    or mode the engine does not support."""
    path = Path(model_path).expanduser()
    folder = path if path.is_dir() else path.parent
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return DECODER_DEFAULT
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(
            f"{modules_file} must hold a list of modules, not {type(modules).__name__}"
        )
    method: PoolingMethod | None = None
    normalize = False
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = _module_class(str(module.get("type", "")))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            if method is not None:
                raise ValueError(f"{modules_file} lists two Pooling modules; expected one")
            method = _read_pooling_module(folder / str(module.get("path", "")))
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(
                f"{modules_file}: module {module.get('path') or module.get('name')!r} of type "
                f"{module.get('type') or 'unknown'} is not supported (supported: Transformer, "
                "Pooling, Normalize); use sentence-transformers for this model"
            )
    if method is None:
        raise ValueError(f"{modules_file} lists no Pooling module: the pooling is unknown")
    return PoolingConfig(method, normalize)


def _module_class(type_name: str) -> str:
    """`sentence_transformers.models.Pooling` (up to version 5) and
    `sentence_transformers.sentence_transformer.modules.pooling.Pooling` (6) -> "Pooling";
    a module from another package -> its full name (never supported)."""
    if not type_name.startswith("sentence_transformers."):
        return type_name
    return type_name.rsplit(".", 1)[-1]


def _read_pooling_module(folder: Path) -> PoolingMethod:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"the Pooling module has no {config_file}")
    config = _read_json(config_file)
    modes = config.get("pooling_mode")
    if modes is None:  # the flags of sentence-transformers 5 and earlier
        modes = [mode for flag, mode in _LEGACY_FLAGS.items() if config.get(flag)] or ["mean"]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1:
        raise ValueError(
            f"{config_file}: pooling modes {modes} are concatenated; the engine pools with one "
            f"of {', '.join(_MODES)}"
        )
    if modes[0] not in _MODES:
        raise ValueError(
            f"{config_file}: pooling mode {modes[0]!r} is not supported; supported: "
            f"{', '.join(_MODES)}"
        )
    if config.get("include_prompt") is False:
        raise ValueError(
            f"{config_file}: include_prompt=false (pooling that skips an instruction prefix) "
            "is not supported"
        )
    return _MODES[modes[0]]


def read_st_max_seq_length(model_path: str | Path, tokenizer=None) -> int | None:
    """The input length sentence-transformers truncates to (`max_seq_length` of
    sentence_bert_config.json, e.g. 256 for all-MiniLM-L6-v2 whose positions go to 512), or
    None when the folder does not say. `do_lower_case: true` (the Transformer module
    lowercases texts before its tokenizer) is accepted when `tokenizer` lowercases by itself,
    as uncased BERT tokenizers do (bge-*): the flag changes nothing then. Otherwise it raises
    ValueError: the engine's tokenization does not lowercase, so cased text would embed
    differently."""
    path = Path(model_path).expanduser()
    config_file = (path if path.is_dir() else path.parent) / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    config = _read_json(config_file)
    if config.get("do_lower_case") and not _lowercases(tokenizer):
        raise ValueError(
            f"{config_file}: do_lower_case=true (sentence-transformers lowercases texts before "
            "tokenizing) is not supported with a cased tokenizer; a tokenizer that lowercases "
            "itself needs no flag"
        )
    length = config.get("max_seq_length")
    return int(length) if length else None


def _lowercases(tokenizer) -> bool:
    """Whether `tokenizer` lowercases text itself: a fast tokenizer's normalizer (BERT's
    uncased one lowercases), or a slow one's do_lower_case."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is not None:
        probe = "The Quick Brown Fox"
        return normalizer.normalize_str(probe) == probe.lower()
    return bool(getattr(tokenizer, "do_lower_case", False))


def _read_json(file: Path):
    """A sentence-transformers file's JSON; ValueError naming the file when it is not JSON."""
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e

"""Complete transformers' config of a GGUF file from the file itself, as llama.cpp reads it.

The engine reads GGUF files through transformers, which builds the config from a table of
llama.cpp metadata keys per architecture (transformers/integrations/ggml.py) and keeps its config
class's defaults for every key the table lacks. For Phi-3 and the Gemmas, llama.cpp's converter
(convert_hf_to_gguf.py) writes hyperparameters that table does not read, so transformers runs
such a file as another model than the one it was converted from. The forward pass here is the
engine's own (only the config and the tensors come from transformers), so this module sets those
values on the config before the model is built, where ModelConfig.from_hf, rope.py and gemma.py
read them:

- Phi-3: LongRoPE (the `rope_factors_long/short.weight` tensors, which transformers' tensor
  loader drops as it maps no parameter to them; the pretraining length
  `rope.scaling.original_context_length`; the attention factor `rope.scaling.attn_factor`), the
  rotary dimensions `rope.dimension_count` (a partial rotary factor, as Phi-4-mini's) and the
  sliding window (Phi-3-mini-4k's 2047; 0 means none). llama.cpp itself runs Phi-3 without
  its window (it warns so when loading the hyperparameters); the window is taken here because
  it is the converted model's (transformers applies it to the Hugging Face checkpoint).
- Gemma 2: the two soft-caps (`attn_logit_softcapping`, `final_logit_softcapping`).
- Gemma 3: the final soft-cap (the Hugging Face model applies it whenever set; llama.cpp's
  graph only for files without a sliding window; Gemma 3's own files state none); the global
  layers' RoPE (`rope.freq_base` and a linear
  `rope.scaling` factor, Gemma 3 4B and larger); the local layers' RoPE base
  (`rope.freq_base_swa`, 10000 when absent, llama.cpp's value); which layers are local: none
  without a (positive) `attention.sliding_window`, else `attention.sliding_window_pattern` (a
  period p, layer i local when i % p < p - 1, or a per-layer list of booleans) or llama.cpp's
  default period 6.
- Both Gemmas: query_pre_attn_scalar, which no file states. llama.cpp decides it by model size
  (src/llama-model.cpp, load_hparams for LLM_ARCH_GEMMA2 / LLM_ARCH_GEMMA3, after
  gemma_pytorch's config.py): queries are scaled by 1 / sqrt(n_embd / n_head) (integer
  division) for the 27B models, recognised by their layer count (Gemma 2: 46, Gemma 3: 62), and
  by 1 / sqrt(head_dim) (`attention.key_length`) for every other size. That is the runtime that
  defines how its files run, and it matches the Hugging Face configs: 144 = 4608 / 32 for
  Gemma 2 27B, 168 = 5376 / 32 for Gemma 3 27B, 256 = head_dim for the others (transformers
  assumes 256 everywhere).

- Llama / Mistral / Qwen2 / Qwen3 (and their MoE files): the RoPE scaling, which transformers'
  reader keeps for none of them. llama.cpp's converter writes Llama 3.x's llama3 scaling as the
  `rope_freqs.weight` tensor, one divisor per rotary pair (1 for high frequencies, `factor` for
  low ones, a blend between; llama.cpp divides each frequency by it): that is exactly a
  per-pair LongRoPE factor list with attention factor 1, so the engine runs it as one (short
  and long factors alike). `rope.scaling.type` linear (with `rope.scaling.factor`, or the old
  `rope.scale_linear`; llama.cpp scales linearly when a factor comes without a type) and yarn
  (factor, `rope.scaling.original_context_length`, the `yarn_beta_fast/slow` and
  `yarn_attn_factor` the converter copies from the Hugging Face config's beta_fast/slow and
  attention_factor) become the matching rope type.

What the engine cannot represent still fails, naming the key: LongRoPE factors without both
tensors or without a pretraining length, rotary dimensions the head cannot hold, a Gemma 3 RoPE
scaling other than linear, a layer pattern that does not fit the layer count, and for the
Llama / Qwen files any other scaling type, a rope.scaling key the engine does not run (a YaRN
extrapolation factor other than 1, a log multiplier, NTK alpha), rope_freqs with YaRN or of
the wrong length, and rotary dimensions other than the head's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-pair frequency divisors (Llama 3.x)
FACTOR_TENSORS = (*LONGROPE_TENSORS, ROPE_FREQS)
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's LLM_TYPE_27B, by layer count
GEMMA3_SWA_PERIOD = 6  # llama.cpp's default for gemma3: five local layers, then one global
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
BY_LLAMA_CPP_RULE = ("query_pre_attn_scalar",)  # set by llama.cpp's rule, stated by no file


@dataclass(frozen=True)
class GgufFile:
    """What the completion reads: the metadata (values as Python scalars or lists) and the
    RoPE factor tensors (FACTOR_TENSORS, float32 values), the only tensors it needs."""

    architecture: str
    metadata: dict[str, object]
    rope_factors: dict[str, list[float]]

    @classmethod
    def read(cls, path: Path) -> GgufFile:
        # imported here, when a GGUF file is read: the H200 image has no gguf package and
        # every engine import must work there (scripts/h200_image)
        import gguf

        reader = gguf.GGUFReader(str(path))
        metadata = {
            key: field.contents()
            for key, field in reader.fields.items()
            if not key.startswith("tokenizer.")  # the vocabulary: large, and not read here
        }
        factors = {
            t.name: gguf.quants.dequantize(t.data, t.tensor_type)
            .astype(np.float32)
            .reshape(-1)
            .tolist()
            for t in reader.tensors
            if t.name in FACTOR_TENSORS
        }
        return cls(str(metadata["general.architecture"]), metadata, factors)

    def key(self, key: str) -> str:
        """The full metadata key: `<architecture>.<key>`."""
        return f"{self.architecture}.{key}"

    def get(self, key: str):
        """The value of `<architecture>.<key>`, or None when the file does not state it."""
        return self.metadata.get(self.key(key))


Taken = dict[str, object]  # config field -> the value set on it, for the log line
Completion = Callable[[GgufFile, object], Taken]


def complete_gguf_config(path: Path, hf_config) -> Taken:
    """Set on `hf_config` (transformers' config of the GGUF file at `path`) what the file states
    and transformers' reader left out, and llama.cpp's query scale for the Gemmas; log what
    changed in one line and return it. Fails naming the key for what the engine cannot run."""
    taken = complete_config(GgufFile.read(path), hf_config)
    stated = [f"{k}={_short(v)}" for k, v in taken.items() if k not in BY_LLAMA_CPP_RULE]
    ruled = [f"{k}={_short(v)}" for k, v in taken.items() if k in BY_LLAMA_CPP_RULE]
    parts = []
    if stated:
        parts.append(f"from the file {', '.join(stated)}")
    if ruled:
        parts.append(f"by llama.cpp's rule for the model's size {', '.join(ruled)}")
    if parts:
        log.info("%s: set beyond transformers' reading of it: %s", path.name, "; ".join(parts))
    return taken


def complete_config(file: GgufFile, hf_config) -> Taken:
    """complete_gguf_config on a file already read: what changed on `hf_config`."""
    completion = _COMPLETIONS.get(file.architecture)
    return {} if completion is None else completion(file, hf_config)


def _phi3(file: GgufFile, cfg) -> Taken:
    taken: Taken = {}
    _refuse_scaling_type(file, ("longrope",))  # the factor tensors below are its scaling
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = dict(cfg.rope_parameters or {})
    rotary = file.get("rope.dimension_count")
    if rotary is not None:
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise _unrepresentable(
                file.key("rope.dimension_count"), f"{rotary} rotary dimensions, heads of {head_dim}"
            )
        rope["partial_rotary_factor"] = rotary / head_dim
    original = file.get("rope.scaling.original_context_length")
    if any(name in file.rope_factors for name in LONGROPE_TENSORS):
        missing = [n for n in LONGROPE_TENSORS if n not in file.rope_factors]
        if missing or original is None:
            absent = missing[0] if missing else file.key("rope.scaling.original_context_length")
            stated = next(n for n in LONGROPE_TENSORS if n in file.rope_factors)
            raise _unrepresentable(stated, f"LongRoPE factors without {absent}")
        long, short = (file.rope_factors[n] for n in LONGROPE_TENSORS)
        _set(cfg, "original_max_position_embeddings", int(original), taken)
        rope.update(
            rope_type="longrope",
            long_factor=long,
            short_factor=short,
            original_max_position_embeddings=int(original),
        )
        if (attention_factor := file.get("rope.scaling.attn_factor")) is not None:
            rope["attention_factor"] = float(attention_factor)
    _set(cfg, "rope_parameters", rope, taken)
    window = file.get("attention.sliding_window")
    if window:  # 0: none (Phi-4's files)
        _set(cfg, "sliding_window", int(window), taken)
    return taken


def _gemma2(file: GgufFile, cfg) -> Taken:
    taken: Taken = {}
    _refuse_scaling_type(file, ())
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (cap := file.get(name)) is not None:
            _set(cfg, name, float(cap), taken)
    _set(cfg, "query_pre_attn_scalar", _llama_cpp_query_scalar(file, cfg), taken)
    return taken


def _gemma3(file: GgufFile, cfg) -> Taken:
    taken: Taken = {}
    if (cap := file.get("final_logit_softcapping")) is not None:
        _set(cfg, "final_logit_softcapping", float(cap), taken)
    built = cfg.rope_parameters or {}
    full = {
        "rope_type": "default",
        "rope_theta": float(
            file.get("rope.freq_base") or built.get("full_attention", {}).get("rope_theta")
        ),
    }
    scaling = file.get("rope.scaling.type")
    if scaling == "linear":
        full.update(rope_type="linear", factor=float(file.get("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise _unrepresentable(
            file.key("rope.scaling.type"), f"{scaling!r}, where Gemma 3 scales linearly or not"
        )
    local_base = file.get("rope.freq_base_swa") or GEMMA3_LOCAL_ROPE_BASE
    local = {"rope_type": "default", "rope_theta": float(local_base)}
    _set(cfg, "rope_parameters", {"sliding_attention": local, "full_attention": full}, taken)
    _set(cfg, "layer_types", _gemma3_layer_types(file, cfg.num_hidden_layers), taken)
    _set(cfg, "query_pre_attn_scalar", _llama_cpp_query_scalar(file, cfg), taken)
    return taken


# rope.scaling keys the Llama / Qwen completion runs, per scaling type; any other one a file
# states is refused. `finetuned` only records that the model was tuned with its scaling, and
# `original_context_length` is llama.cpp's YaRN length (read whatever the type, used by YaRN
# only).
_SCALING_ALWAYS = (
    "rope.scaling.type",
    "rope.scaling.finetuned",
    "rope.scaling.original_context_length",
)
_SCALING_READ = {
    "none": (),
    "linear": ("rope.scaling.factor", "rope.scale_linear"),
    "yarn": (
        "rope.scaling.factor",
        "rope.scaling.yarn_beta_fast",
        "rope.scaling.yarn_beta_slow",
        "rope.scaling.yarn_attn_factor",
        "rope.scaling.yarn_ext_factor",
    ),
}
_YARN_KEYS = {  # GGUF key -> transformers' yarn parameter (the converter's own mapping)
    "rope.scaling.yarn_beta_fast": "beta_fast",
    "rope.scaling.yarn_beta_slow": "beta_slow",
    "rope.scaling.yarn_attn_factor": "attention_factor",
}


def _scaled_rope(file: GgufFile, cfg) -> Taken:
    """Llama, Mistral, Qwen2, Qwen3 and their MoE files: the RoPE scaling transformers' reader
    drops (rope.scaling.* and the rope_freqs tensor), as a rope type the engine runs."""
    taken: Taken = {}
    _check_rotary_dimensions(file, cfg)
    built = dict(cfg.rope_parameters or {})
    theta = float(file.get("rope.freq_base") or built.get("rope_theta") or 10000.0)
    rope: dict = {"rope_type": "default", "rope_theta": theta}
    factor = file.get("rope.scaling.factor")
    if factor is None:
        factor = file.get("rope.scale_linear")  # llama.cpp's older key for the same factor
    scaling = file.get("rope.scaling.type")
    if scaling is None:  # llama.cpp's default type: linear, by the factor when one is stated
        scaling = "none" if factor is None else "linear"
    if scaling not in _SCALING_READ:
        raise _unrepresentable(
            file.key("rope.scaling.type"),
            f"{scaling!r}, where the engine runs none, linear or yarn for {file.architecture}",
        )
    _refuse_unread_scaling(file, scaling)
    if scaling == "linear" and factor not in (None, 0, 1):
        rope.update(rope_type="linear", factor=float(factor))
    elif scaling == "yarn":
        rope.update(_yarn(file, cfg, factor))
    if ROPE_FREQS in file.rope_factors:
        rope = _per_pair_factors(file, cfg, rope)
    if rope != {"rope_type": "default", "rope_theta": theta}:
        _set(cfg, "rope_parameters", {**built, **rope}, taken)
    return taken


def _check_rotary_dimensions(file: GgufFile, cfg) -> None:
    """These architectures rotate the whole head; a file stating fewer rotary dimensions is
    another model (transformers even takes llama's rope.dimension_count as its head_dim)."""
    rotary = file.get("rope.dimension_count")
    head_dim = file.get("attention.key_length") or (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    )
    if rotary is not None and int(rotary) != int(head_dim):
        raise _unrepresentable(
            file.key("rope.dimension_count"),
            f"{rotary} rotary dimensions in heads of {head_dim}, where {file.architecture} "
            "rotates the whole head",
        )


def _refuse_unread_scaling(file: GgufFile, scaling: str) -> None:
    """Fail on any rope.scaling key the engine would not run for this scaling type."""
    read = {*_SCALING_ALWAYS, *_SCALING_READ[scaling]}
    prefixes = (file.key("rope.scaling."), file.key("rope.scale_"))
    for key in sorted(file.metadata):
        if key.startswith(prefixes) and key[len(file.architecture) + 1 :] not in read:
            raise _unrepresentable(
                key,
                f"{file.metadata[key]!r} with {scaling!r} RoPE scaling, which the engine "
                "does not run",
            )
    ext = file.get("rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) != 1.0:  # transformers' YaRN ramps fully: factor 1
        raise _unrepresentable(
            file.key("rope.scaling.yarn_ext_factor"), f"{ext}, where the engine's YaRN runs 1.0"
        )


def _yarn(file: GgufFile, cfg, factor) -> dict:
    """transformers' yarn parameters from the keys the converter writes."""
    if factor is None:
        raise _unrepresentable(file.key("rope.scaling.type"), "'yarn' without rope.scaling.factor")
    original = file.get("rope.scaling.original_context_length") or cfg.max_position_embeddings
    yarn = {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": int(original),
    }
    for key, name in _YARN_KEYS.items():
        if (value := file.get(key)) is not None:
            yarn[name] = float(value)
    return yarn


def _per_pair_factors(file: GgufFile, cfg, rope: dict) -> dict:
    """rope_freqs.weight as per-pair divisors: LongRoPE's factor lists (the same for short and
    long contexts) with attention factor 1. A linear factor divides every pair as well."""
    factors = file.rope_factors[ROPE_FREQS]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if len(factors) != head_dim // 2:
        raise _unrepresentable(
            ROPE_FREQS,
            f"{len(factors)} factors, where heads of {head_dim} have {head_dim // 2} pairs",
        )
    if rope["rope_type"] == "yarn":
        raise _unrepresentable(ROPE_FREQS, "per-pair factors together with YaRN scaling")
    linear = float(rope.get("factor", 1.0))
    pairs = [f * linear for f in factors]
    return {
        "rope_type": "longrope",
        "rope_theta": rope["rope_theta"],
        "short_factor": pairs,
        "long_factor": pairs,
        "original_max_position_embeddings": int(cfg.max_position_embeddings),
        "attention_factor": 1.0,
    }


def _refuse_scaling_type(file: GgufFile, runs: tuple[str, ...]) -> None:
    """Fail on a rope.scaling.type this completion does not run (other than none)."""
    scaling = file.get("rope.scaling.type")
    if scaling not in (None, "none", *runs):
        raise _unrepresentable(
            file.key("rope.scaling.type"),
            f"{scaling!r}, which the engine does not run for {file.architecture}",
        )


def _gemma3_layer_types(file: GgufFile, num_layers: int) -> list[str]:
    """llama.cpp's local ("sliding_attention") and global layers of a gemma3 file."""
    window = file.get("attention.sliding_window")
    if not window:
        return ["full_attention"] * num_layers
    pattern = file.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise _unrepresentable(
                file.key("attention.sliding_window_pattern"),
                f"{len(pattern)} layers where the file has {num_layers}",
            )
        local = [bool(p) for p in pattern]
    else:  # llama_hparams::set_swa_pattern: period 0, every layer local; 1, none
        period = GEMMA3_SWA_PERIOD if pattern is None else int(pattern)
        local = [period == 0 or i % period < period - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in local]


def _llama_cpp_query_scalar(file: GgufFile, cfg) -> int:
    """llama.cpp's f_attention_scale, as the scalar whose inverse square root it is."""
    if cfg.num_hidden_layers == GEMMA_27B_LAYERS[file.architecture]:
        return cfg.hidden_size // cfg.num_attention_heads
    return int(file.get("attention.key_length") or cfg.head_dim)


def _set(cfg, name: str, value, taken: Taken) -> None:
    """Set `name` on the config, noting it in `taken` when transformers built another value."""
    if getattr(cfg, name, None) != value:
        taken[name] = value
    setattr(cfg, name, value)


def _unrepresentable(name: str, what: str) -> ValueError:
    """The error for a value the engine has no way to run: `name` is the key or tensor."""
    return ValueError(
        f"GGUF {name}: {what}; the engine cannot run this file as llama.cpp does (load the "
        "Hugging Face checkpoint it was converted from instead)"
    )


def _short(value) -> str:
    """A config value for the log line: factor lists by their length."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list) and len(value) > 4:
        return f"[{len(value)} values]"
    return repr(value)


SCALED_ROPE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen2moe", "qwen3", "qwen3moe")
"""llama.cpp's architecture names whose RoPE scaling `_scaled_rope` completes."""


def _refuse_gemma4(file: GgufFile, cfg) -> Taken:
    """Gemma 4 GGUF files are refused: transformers' reader maps few of their keys (no layer
    types, per-layer shapes, KV-shared layers or per-layer inputs), so a model built from its
    config would answer wrongly."""
    raise ValueError(
        "Gemma 4 GGUF files are not supported yet (their layer types, per-layer head sizes "
        "and KV-shared layers are not read): load the Hugging Face folder instead"
    )


_COMPLETIONS: dict[str, Completion] = {
    "gemma4": _refuse_gemma4,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    **{arch: _scaled_rope for arch in SCALED_ROPE_ARCHITECTURES},
}

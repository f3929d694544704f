"""Tiny GGUF files written from tiny Hugging Face checkpoints, as llama.cpp's converter writes them.

llama.cpp's converter (convert_hf_to_gguf.py) is not a Python package, so this writes what it
would with the gguf package: llama.cpp's metadata keys, its tensor names (gguf's TensorNameMap,
the converter's own table), float32 tensors, and a vocabulary of the checkpoint's size so that
transformers can build a tokenizer from the file, as the engine's GGUF loader asks it to. Per
architecture, as the converter does:

- Qwen3 / Qwen3-MoE: a byte-level BPE vocabulary (the 256 byte symbols, one merge, filler
  tokens); experts stacked as ffn_{gate,up,down}_exps.
- Phi-3: q, k, v fused as attn_qkv and [gate; up] as ffn_up (the checkpoint's own qkv_proj and
  gate_up_proj); the rotary dimensions and pretraining length as metadata, LongRoPE factors as
  the rope_factors_long/short tensors; sliding_window 0 when the checkpoint has none.
- Gemma 2 / Gemma 3: every RMSNorm weight stored with 1 added (llama.cpp's norm multiplies by
  w where Gemma's multiplies by 1 + w), no output tensor (the head is the token embedding), the
  soft-caps and sliding window as metadata; Gemma 3's global RoPE base as rope.freq_base and its
  linear factor as rope.scaling.
- Llama: q and k permuted to llama.cpp's interleaved rotary layout (its LlamaModel.permute,
  which transformers' reader undoes); a Llama 3.x llama3 scaling as the `rope_freqs` tensor
  (one divisor per rotary pair, LlamaModel.generate_extra_tensors) with the converter's
  pretraining length: the config's top-level original_max_position_embeddings, else 8192
  (Llama 3.1's), never the one inside rope_scaling.
- Llama, Qwen2, Qwen3: linear and yarn scaling as rope.scaling metadata (TextModel's
  set_gguf_parameters: type, factor, and for yarn original_context_length and, when the config
  has them, yarn_beta_fast/slow and yarn_attn_factor from beta_fast/slow and attention_factor).
- Llama and Qwen2 / Qwen3: a byte-level BPE vocabulary (pre-tokenizer llama-bpe or qwen2).
- Phi-3 and Gemma: a SentencePiece vocabulary (tokenizer model "llama": the family's special
  tokens, the 256 byte tokens, a few pieces, unused fillers, with scores and token types).

transformers' GGUF reader does not take every field it needs from the file, so gguf_config
shapes each kind to the values it assumes: it keeps Qwen3Config's head_dim 128 and
Qwen3MoeConfig's moe_intermediate_size 768; for Phi-3 it reads neither LongRoPE, a partial rotary
factor nor a sliding window (plain RoPE over the whole head, full attention); for Gemma 2 it
keeps the default soft-caps (50, 30) and, for both Gemmas, query_pre_attn_scalar 256 (so
head_dim 256 here, where llama.cpp's rule gives the same); Gemma 3 gets its layer pattern from
the default sliding_window_pattern 6 (six layers here: five local, one global) and no RoPE
scaling. Files stating other values (tests.tiny_models' own phi3, gemma2 and gemma3: LongRoPE,
small soft-caps, a linear factor) are what the engine completes the config from
(engine/model/gguf.py).

Gemma 3's converter writes no layer pattern (llama.cpp assumes period 6); for a checkpoint whose
layer_types follow another period (tests.tiny_models' gemma3: local, local, global) this writes
it as attention.sliding_window_pattern, the key llama.cpp reads a period from.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.tiny_models import BOS, EOS, randomize_weights, tiny_config

GGUF_KINDS = ("qwen3", "qwen3-moe")
"""The Qwen3 kinds (tests/engine/model/test_gguf_qwen3.py)."""

PHI3_GEMMA_GGUF_KINDS = ("phi3", "gemma2", "gemma3")
"""Phi-3 and the Gemmas (tests/engine/model/test_gguf_phi3_gemma.py)."""

ROPE_GGUF_KINDS = ("llama3", "qwen3-yarn", "qwen2-linear")
"""RoPE scalings transformers' reader drops (tests/engine/model/test_gguf_rope_scaling.py):
Llama 3.1's llama3 scaling (as rope_freqs), Qwen3's YaRN and a linear factor on Qwen2."""

_ALL_KINDS = GGUF_KINDS + PHI3_GEMMA_GGUF_KINDS + ROPE_GGUF_KINDS

LLAMA31_ROPE = {  # Llama 3.1 8B's config.json, as transformers 5 reads it
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA31_CONTEXT = 131072
CONVERTER_LLAMA3_CONTEXT = 8192  # the converter's pretraining length when the config has none
YARN_ORIGINAL = 32  # the tiny YaRN's pretraining length: the tests' prompts pass it

_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_GEMMA_ARCHS = ("gemma2", "gemma3")
GEMMA3_LAYERS = 6  # transformers' default sliding_window_pattern: five local layers, one global
GEMMA3_SWA_PERIOD = 6  # llama.cpp's default for gemma3 (a file states another period)


def gguf_config(kind: str) -> PretrainedConfig:
    """tests.tiny_models' config of `kind`, with the values transformers' GGUF reader assumes
    where it reads none from the file (see the module docstring)."""
    if kind not in _ALL_KINDS:
        raise ValueError(f"no tiny GGUF of {kind!r}; expected one of {', '.join(_ALL_KINDS)}")
    if kind in ROPE_GGUF_KINDS:
        return _rope_config(kind)
    config = tiny_config(kind)
    if kind in GGUF_KINDS:
        config.head_dim = 128
    if kind == "qwen3-moe":
        config.moe_intermediate_size = 768
        config.mlp_only_layers = []
    if kind == "phi3":
        config.rope_parameters = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
        }
    if kind in ("gemma2", "gemma3"):
        config.head_dim = config.query_pre_attn_scalar = 256
    if kind == "gemma2":
        config.attn_logit_softcapping, config.final_logit_softcapping = 50.0, 30.0
    if kind == "gemma3":
        config.num_hidden_layers = GEMMA3_LAYERS
        config.layer_types = ["sliding_attention"] * (GEMMA3_LAYERS - 1) + ["full_attention"]
        config.rope_parameters = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        }
    return config


def _rope_config(kind: str) -> PretrainedConfig:
    """ROPE_GGUF_KINDS: tiny Llama / Qwen shapes transformers reads whole from a file (Qwen3:
    its head_dim 128), with a RoPE scaling it does not read."""
    if kind == "llama3":
        config = tiny_config("llama-gqa")
        config.rope_parameters = dict(LLAMA31_ROPE)
        config.max_position_embeddings = LLAMA31_CONTEXT
    elif kind == "qwen3-yarn":
        config = gguf_config("qwen3")
        config.rope_parameters = {
            "rope_type": "yarn",
            "rope_theta": config.rope_parameters["rope_theta"],
            "factor": 4.0,
            "original_max_position_embeddings": YARN_ORIGINAL,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
        }
        config.max_position_embeddings = 4 * YARN_ORIGINAL  # the factor's context, as Qwen's
    else:
        config = tiny_config("qwen2")
        config.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    return config


def build_tiny_gguf(
    kind: str, folder: Path, seed: int = 0, config: PretrainedConfig | None = None
) -> tuple[Path, Path]:
    """A tiny random `kind` (GGUF_KINDS or PHI3_GEMMA_GGUF_KINDS) of gguf_config's shape, or of
    `config` when given, saved both as a Hugging Face folder and as a GGUF file in `folder`:
    (hf_folder, gguf_path)."""
    config = gguf_config(kind) if config is None else config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model, 1000 + seed * len(_ALL_KINDS) + _ALL_KINDS.index(kind))
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS)
    hf_folder = Path(folder) / "hf"
    model.save_pretrained(hf_folder)
    return hf_folder, write_tiny_gguf(hf_folder, Path(folder) / f"{kind}.gguf")


def write_tiny_gguf(hf_folder: Path, path: Path) -> Path:
    """Write the checkpoint in `hf_folder` (model_type llama, qwen2, qwen3, qwen3_moe, phi3,
    gemma2 or gemma3_text) as the GGUF `path`, as llama.cpp's converter would."""
    cfg = json.loads((Path(hf_folder) / "config.json").read_text())
    arch = _ARCH[cfg["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    _add_metadata(writer, arch, cfg)
    if arch in _BYTE_LEVEL_PRE:
        _add_byte_level_vocabulary(
            writer, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"], arch
        )
    else:
        _add_sentencepiece_vocabulary(writer, arch, cfg)
    state_dict = load_file(str(Path(hf_folder) / "model.safetensors"))
    for name, tensor in sorted(_gguf_tensors(arch, cfg, state_dict)):
        writer.add_tensor(name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_metadata(writer: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    """The hyperparameters each architecture's converter class writes (its set_gguf_parameters)."""
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    rope = cfg["rope_parameters"]
    if arch in _BYTE_LEVEL_PRE:  # TextModel's rules (Llama, Qwen2, Qwen3)
        if cfg.get("head_dim") is not None:
            writer.add_key_length(cfg["head_dim"])
            writer.add_value_length(cfg["head_dim"])
        writer.add_rope_freq_base(rope["rope_theta"])
        _add_rope_scaling(writer, rope)
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_rope_dimension_count(_head_dim(cfg))
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "phi3":
        n_embd, n_head = cfg["hidden_size"], cfg["num_attention_heads"]
        writer.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        writer.add_rope_dimension_count(
            int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head
        )
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_sliding_window(cfg.get("sliding_window") or 0)  # 0: none (Phi-4)
        if rope.get("long_factor"):
            orig = cfg["original_max_position_embeddings"]
            scale = cfg["max_position_embeddings"] / orig
            attn_factor = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
            writer.add_rope_scaling_attn_factors(attn_factor)
    if arch in _GEMMA_ARCHS:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "gemma3":
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])  # the global layers' (llama.cpp: 10000 local)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        period = _layer_period(cfg["layer_types"])
        if period != GEMMA3_SWA_PERIOD:
            writer.add_sliding_window_pattern(period)


def _add_rope_scaling(writer: gguf.GGUFWriter, rope: dict) -> None:
    """TextModel.set_gguf_parameters: linear and yarn scaling as metadata (llama3 is a tensor)."""
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if (attn := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
            writer.add_rope_scaling_yarn_attn_factor(attn)
        if (beta_fast := rope.get("beta_fast")) is not None:
            writer.add_rope_scaling_yarn_beta_fast(beta_fast)
        if (beta_slow := rope.get("beta_slow")) is not None:
            writer.add_rope_scaling_yarn_beta_slow(beta_slow)


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def llama3_rope_freqs(cfg: dict) -> torch.Tensor:
    """The converter's rope_freqs for a llama3 scaling (LlamaModel.generate_extra_tensors): one
    divisor per rotary pair, from the frequencies in float32 as it computes them. Its
    pretraining length is the config's top-level original_max_position_embeddings or 8192."""
    rope = cfg["rope_parameters"]
    dim = _head_dim(cfg)
    freqs = 1.0 / (rope.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2).float() / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = cfg.get("original_max_position_embeddings", CONVERTER_LLAMA3_CONTEXT)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _layer_period(layer_types: list[str]) -> int:
    """The period p of layer types that are local but every p-th (llama.cpp's swa pattern)."""
    for period in range(1, len(layer_types) + 2):
        local = [i % period < period - 1 for i in range(len(layer_types))]
        if local == [t == "sliding_attention" for t in layer_types]:
            return period
    raise ValueError(f"layer types {layer_types} have no llama.cpp period")


_BYTE_LEVEL_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2"}


def _add_byte_level_vocabulary(writer, vocab_size: int, bos: int, eos: int, arch: str) -> None:
    symbols = list(bytes_to_unicode().values())  # the 256 byte-level symbols
    tokens = symbols + ["ab"] + [f"<filler{i}>" for i in range(vocab_size - len(symbols) - 1)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_BYTE_LEVEL_PRE[arch])
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)


_PIECES = ("\u2581", "a", "b", "\u2581a", "ab", "\u2581ab")
_T = gguf.TokenType
# Each family's special tokens in its own spelling (at the tiny checkpoints' ids: BOS 1, EOS 2,
# padding 0), so that transformers' tokenizer class for the family finds them in the vocabulary.
_SPECIALS = {
    "phi3": (("<unk>", _T.UNKNOWN), ("<s>", _T.CONTROL), ("</s>", _T.CONTROL)),
    "gemma": (
        ("<pad>", _T.CONTROL),
        ("<bos>", _T.CONTROL),
        ("<eos>", _T.CONTROL),
        ("<unk>", _T.UNKNOWN),
        ("<mask>", _T.CONTROL),
    ),
}


def _add_sentencepiece_vocabulary(writer, arch: str, cfg: dict) -> None:
    """A SentencePiece vocabulary as the converter writes one (its _set_vocab_sentencepiece):
    the special tokens, the 256 byte tokens, a few pieces with descending scores, and unused
    [PAD] fillers up to the checkpoint's vocabulary size."""
    specials = _SPECIALS["gemma" if arch in _GEMMA_ARCHS else arch]
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)] + list(_PIECES)
    toktypes = [k for _, k in specials] + [_T.BYTE] * 256 + [_T.NORMAL] * len(_PIECES)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(_PIECES))]
    fillers = cfg["vocab_size"] - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(fillers)]
    toktypes += [_T.UNUSED] * fillers
    scores += [-10000.0] * fillers
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(toktypes)
    writer.add_unk_token_id(tokens.index("<unk>"))
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        writer.add_pad_token_id(cfg["pad_token_id"])
    if arch in _GEMMA_ARCHS:
        writer.add_add_space_prefix(False)


def _gguf_tensors(arch: str, cfg: dict, state_dict: dict[str, torch.Tensor]):
    """(GGUF name, tensor) pairs: names from gguf's TensorNameMap, Gemma's norms + 1, the tied
    head left out, experts stacked, Phi-3's LongRoPE factors added."""
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg["num_hidden_layers"]
    )
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            tensor = _permute(tensor, heads)
        if m := _EXPERT.fullmatch(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = tensor
            continue
        if name == "lm_head.weight" and (arch in _GEMMA_ARCHS or cfg.get("tie_word_embeddings")):
            continue  # the converter skips Gemma's lm_head; a tied one is not saved
        if arch in _GEMMA_ARCHS and name.endswith("norm.weight"):
            tensor = tensor + 1
        module, _, leaf = name.rpartition(".")
        gguf_name = names.get_name(module)
        if gguf_name is None:
            raise ValueError(f"gguf has no {arch} tensor name for {name}")
        yield f"{gguf_name}.{leaf}", tensor
    for (layer, proj), by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
        yield f"blk.{layer}.ffn_{proj}_exps.weight", stacked
    rope = cfg.get("rope_parameters") or {}
    if arch == "llama" and rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_freqs(cfg)
    if arch == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32)


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rotate-half layout to interleaved pairs."""
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )

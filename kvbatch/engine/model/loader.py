"""Load a checkpoint into the engine's own modules.

Two sources: a Hugging Face folder (config.json, safetensors, sharded or not, tokenizer files)
or a single GGUF file, read and dequantised by transformers' GGUF reader. transformers provides
configs, tokenizers and the GGUF reader; the forward pass is always ours (engine/models/).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvbatch.engine.layers.linear import merge_projections
from kvbatch.engine.model.architectures import ENCODER_ARCHITECTURES
from kvbatch.engine.model.bert import BASE_MODEL_PREFIXES, BertConfig, BertModel, build_bert
from kvbatch.engine.model.checkpoint_errors import (
    CONFIG,
    CheckpointError,
    ShapeMismatch,
    check_config_values,
    check_shapes,
    read_json_object,
    read_safetensors,
)
from kvbatch.engine.model.experts_loader import (
    install_quantized_experts,
    quantize_experts_online,
    split_experts,
)
from kvbatch.engine.model.gguf import complete_gguf_config
from kvbatch.engine.model.moe import CheckpointExperts
from kvbatch.engine.model.multimodal import language_model_config, language_model_weights
from kvbatch.engine.model.registry import ARCHITECTURES
from kvbatch.engine.model.sequence_classifier import (
    SequenceClassificationHead,
    build_head,
    pop_head_tensors,
)
from kvbatch.engine.model.tensor_names import some_names
from kvbatch.engine.models.gemma import GemmaForCausalLM
from kvbatch.engine.models.llama import LlamaForCausalLM, ModelConfig
from kvbatch.engine.quant.apply import quantize_linears, reject_quantized_leftovers, weight_bytes
from kvbatch.engine.quant.detect import detect_quantization
from kvbatch.engine.quant.mxfp4 import install_mxfp4_experts
from kvbatch.engine.quant.scheme import QuantConfig

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")  # a quantized KV cache's, kept for the KV cache
LEGACY_KV_SCALES = {
    ".kv_scale": (".k_scale", ".v_scale"),  # AutoFP8: one scale for K and V
    ".k_proj.output_scale": (".k_scale",),  # llm-compressor before the attention's own names
    ".v_proj.output_scale": (".v_scale",),
}
"""Older writers' names for the KV-cache scales, and the names they stand for (vLLM reads them
the same way)."""


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM | GemmaForCausalLM
    tokenizer: object | None  # a transformers tokenizer, or None for token-id-only checkpoints
    eos_token_ids: tuple[int, ...]
    quantization: QuantConfig | None = None  # the checkpoint's, or the online one asked for
    weight_bytes: int = 0  # the weights as the forward pass holds them (quantized or not)
    # A quantized KV cache's scales as the checkpoint stores them ("model.layers.0.self_attn.
    # k_scale" -> float32 tensor), with quantization.kv_cache_scheme saying how they were made.
    kv_cache_scales: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def quantization_method(self) -> str | None:
        return None if self.quantization is None else self.quantization.method


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> LoadedModel:
    """Load a Hugging Face folder or a .gguf file; errors say what is missing.

    A checkpoint's config.json `quantization_config` is read before any weight and picks each
    layer's quantized module (engine/quant); `quantization="fp8"` quantizes a float checkpoint
    at load. Formats the engine cannot run fail here, never at the first answer. A broken
    file is a CheckpointError: one line naming the file and the problem."""
    path = Path(path).expanduser()
    with _as_checkpoint_error(path):
        return _load_model(path, dtype, device, quantization)


def _load_model(
    path: Path, dtype: torch.dtype, device: torch.device, quantization: str | None
) -> LoadedModel:
    if not path.exists():
        raise FileNotFoundError(
            f"model path {path} does not exist (pass a Hugging Face folder "
            "with config.json and safetensors, or a .gguf file)"
        )
    if path.is_file() and path.suffix == ".gguf":
        quant = detect_quantization(None, quantization)
        hf_config, state_dict, tokenizer = _read_gguf(path)
        generation_eos: list[int] = []
    elif path.is_dir():
        quant = detect_quantization(_config_dict(path), quantization)
        hf_config, state_dict, tokenizer = _read_hf_folder(path)
        generation_eos = _generation_eos(path)
    else:
        raise ValueError(f"model path {path} is neither a folder nor a .gguf file")
    cfg = ModelConfig.from_hf(hf_config)
    if not cfg.has_lm_head:  # a base model's weights lack the "model." of a causal LM's
        state_dict = {
            k if k.startswith("model.") else f"model.{k}": v for k, v in state_dict.items()
        }
    kv_scales = _pop_kv_scales(state_dict)
    adapt = ARCHITECTURES[cfg.architecture].adapt_checkpoint  # e.g. Phi-3's fused tensors
    if adapt is not None:
        state_dict = adapt(state_dict, cfg)
    quantized_experts: list[CheckpointExperts] = []
    if cfg.moe is not None:
        state_dict, quantized_experts = split_experts(state_dict, cfg.moe.num_experts, quant)
    try:
        model = _build(cfg, state_dict, dtype, device, quant, quantized_experts)
    except ShapeMismatch as e:  # weights and config.json disagree
        raise CheckpointError(path / CONFIG if path.is_dir() else path, str(e)) from None
    eos = list(cfg.eos_token_ids) + generation_eos
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return LoadedModel(
        cfg, model, tokenizer, tuple(dict.fromkeys(eos)), quant, weight_bytes(model), kv_scales
    )


def is_encoder_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face folder of an encoder (config.json's architecture in
    ENCODER_ARCHITECTURES): the encoder engine runs it, not the paged decoder engine."""
    path = Path(path).expanduser()
    config = _config_dict(path) if path.is_dir() else None
    return bool(config) and (config.get("architectures") or [None])[0] in ENCODER_ARCHITECTURES


@dataclass
class LoadedEncoder:
    config: BertConfig
    model: BertModel
    tokenizer: object | None
    weight_bytes: int = 0
    head: SequenceClassificationHead | None = None  # a cross-encoder's


def load_encoder(path: str | Path, dtype: torch.dtype, device: torch.device) -> LoadedEncoder:
    """Load an encoder folder (engine/model/bert.py); errors name what the forward lacks."""
    path = Path(path).expanduser()
    with _as_checkpoint_error(path):
        cfg = BertConfig.from_hf(_config_dict(path) or {})
        weights = _read_weights(path)
        head = None
        if cfg.num_labels:  # a cross-encoder: its head's tensors apart from the encoder's
            tensors = pop_head_tensors(weights, BASE_MODEL_PREFIXES)
            head = build_head(
                cfg.architecture, cfg.hidden_size, cfg.num_labels, tensors, dtype, device
            )
        model = build_bert(cfg, weights, dtype, device)
        return LoadedEncoder(cfg, model, _read_tokenizer(path), weight_bytes(model), head)


def _pop_kv_scales(state_dict: dict) -> dict:
    """The KV-cache scales, under the attention's names (`...self_attn.k_scale`), taken out of
    the weights; older writers' names are renamed."""
    scales = {}
    for name in list(state_dict):
        if name.endswith(KV_SCALE_SUFFIXES):
            scales[name] = state_dict.pop(name)
            continue
        for old, new_suffixes in LEGACY_KV_SCALES.items():
            if name.endswith(old):
                tensor = state_dict.pop(name)
                for suffix in new_suffixes:
                    scales.setdefault(name.removesuffix(old) + suffix, tensor)
                break
    return scales


def _build(
    cfg: ModelConfig,
    state_dict: dict,
    dtype: torch.dtype,
    device,
    quant: QuantConfig | None,
    quantized_experts: list[CheckpointExperts] = (),
) -> LlamaForCausalLM | GemmaForCausalLM:
    """Create the modules without initialising them, swap in the quantized layers and experts
    (which arrive with their tensors), then adopt the checkpoint's remaining tensors."""
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.architecture].model_class(cfg)
    if cfg.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    if quant is not None:
        quantize_linears(model, state_dict, quant, dtype, device)
        install_quantized_experts(
            model, quantized_experts, cfg.moe.num_experts if cfg.moe else 0, quant, dtype, device
        )
        quantize_experts_online(model, state_dict, quant, device)
        install_mxfp4_experts(model, state_dict, quant, device)
    reject_quantized_leftovers(state_dict, quant)  # before "missing": it names the cause
    owned = model.state_dict()
    _reject_unused_tensors(state_dict, owned)
    expected = {k for k, v in owned.items() if v.is_meta}
    missing = sorted(expected - set(state_dict))
    if missing:
        shown = some_names(missing, 5)
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
    check_shapes(state_dict, {k: owned[k] for k in expected}, cfg)
    weights = {k: state_dict[k].to(device=device, dtype=_dtype_of(k, dtype)) for k in expected}
    weights.update((k, v) for k, v in owned.items() if k not in expected)
    model.load_state_dict(weights, assign=True, strict=True)
    model.rebuild_rotary(device)  # its buffers were built on meta
    merge_projections(model)  # q/k/v and gate/up as one GEMM each (engine/layers/linear.py)
    return model.eval()


FLOAT32_TENSOR_SUFFIXES = ("e_score_correction_bias",)
"""Tensors kept in float32 whatever the model's dtype, as transformers keeps them: DeepSeek-V3's
router correction bias, whose small differences between experts pick the experts."""


def _dtype_of(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FLOAT32_TENSOR_SUFFIXES) else dtype


IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
"""Tensors some checkpoints carry that the forward recomputes (old Llama files' RoPE buffers)."""


def _reject_unused_tensors(state_dict: dict, owned: dict) -> None:
    """A tensor no module takes means config.json does not describe the weights: biases its
    switches leave out (Llama's mlp_bias, an attention_bias), layers past num_hidden_layers,
    modules of a feature kvbatch lacks. Dropping them would load and answer wrongly, so the
    load fails naming them (vLLM's loaders refuse a name they have no parameter for, too)."""
    unused = sorted(
        k for k in state_dict if k not in owned and not k.endswith(IGNORED_TENSOR_SUFFIXES)
    )
    if not unused:
        return
    shown = some_names(unused)
    if all(k.endswith(".bias") for k in unused):
        raise ValueError(
            f"checkpoint has {len(unused)} bias tensors the model built from config.json has "
            f"no place for ({shown}): config.json does not switch on the biases its weights "
            "have (attention_bias, mlp_bias), or the architecture does not use them"
        )
    raise ValueError(
        f"checkpoint has {len(unused)} tensors the model built from config.json has no place "
        f"for ({shown}): config.json does not describe these weights (num_hidden_layers, or a "
        "module of a feature kvbatch does not run); check that config.json belongs to them"
    )


def _config_dict(path: Path) -> dict | None:
    """config.json as written (None when absent: _read_hf_folder names that error)."""
    config = path / CONFIG
    return read_json_object(config) if config.exists() else None


def _read_hf_folder(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
    try:
        read = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers' checks of the values (a float that is an int, ...)
        raise CheckpointError(path / CONFIG, f"{type(e).__name__}: {e}") from None
    check_config_values(read, path / CONFIG)
    hf_config, multimodal = language_model_config(read)
    ModelConfig.from_hf(hf_config)  # fail on an unsupported architecture before reading weights
    state_dict = _read_weights(path)
    if multimodal:  # the text model of a vision-language checkpoint
        state_dict = language_model_weights(state_dict)
    return hf_config, state_dict, _read_tokenizer(path)


def _read_tokenizer(path: Path):
    """The folder's tokenizer, or None when it has no tokenizer files."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # tokenizers' parse errors, a KeyError for a missing section, ...
        named = [n for n in TOKENIZER_FILES if (path / n).is_file()]
        raise CheckpointError(
            path / named[0],
            f"the tokenizer cannot be read ({type(e).__name__}: {e}): check {', '.join(named)}",
        ) from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(s, str) for s in weight_map.values()
        ):
            raise CheckpointError(index, "has no 'weight_map' of tensor names to shard files")
        files = [path / s for s in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"weight shard {f} listed in {index.name} is missing")
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors weights")
    return read_safetensors(files)


def _generation_eos(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.exists():
        return []
    eos = read_json_object(gen).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


def _read_gguf(path: Path):
    """GGUF through transformers: config, dequantised tensors with HF names, tokenizer.

    What the file states and transformers' reader drops is set on the config before the model
    is built, as llama.cpp reads it (engine/model/gguf.py); what the engine cannot run fails.
    Phi-3's fused qkv_proj / gate_up_proj arrive as in a Hugging Face folder (load_model splits
    them); Gemma's norms arrive without llama.cpp's + 1 (transformers' reader subtracts it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    ModelConfig.from_hf(hf_config)
    complete_gguf_config(path, hf_config)
    with torch.device("meta"):  # only its parameter names are used, to map GGUF tensor names
        shell = AutoModelForCausalLM.from_config(hf_config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shell)["tensors"]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    state_dict = {k: torch.as_tensor(v) for k, v in tensors.items()}
    return hf_config, state_dict, tokenizer


@contextmanager
def _as_checkpoint_error(path: Path) -> Iterator[None]:
    """Whatever a library raises on a file it cannot use becomes one CheckpointError naming
    `path`; the engine's own typed errors (they already name the fix), a missing file and
    running out of memory pass through."""
    try:
        yield
    except (CheckpointError, FileNotFoundError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:
        if _ours(e):
            raise
        raise CheckpointError(path, _problem(e)) from None


def _ours(e: Exception) -> bool:
    """An error class kvbatch defines (CheckpointFormatError, ...): callers catch it by type."""
    return type(e).__module__.startswith("kvbatch.")


def _problem(e: Exception) -> str:
    """A library's error as the problem of a CheckpointError (ValueErrors already say it)."""
    return str(e) if isinstance(e, ValueError) else f"cannot be loaded ({type(e).__name__}: {e})"

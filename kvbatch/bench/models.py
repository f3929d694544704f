"""Random-weight models for the GPU workloads, built from a transformers config (Llama, dense
Qwen3, Qwen3-MoE or gpt-oss, whose experts are drawn directly in MXFP4 as published).

No network: the shape is a config, the weights are drawn from a seeded generator, and the
result is an ordinary Hugging Face folder (config.json + model.safetensors, no tokenizer:
prompts are token ids) that kvbatch and transformers both load. Folders are cached under
`$KVBATCH_CACHE/random-models/` (default ~/.cache/kvbatch), keyed by the spec, and written
atomically so that an interrupted build is never mistaken for a finished one.

Weights follow transformers' initialisation (normal, std `initializer_range`; RMSNorm weights
1) so activations stay in range through all layers, but they are drawn directly in the target
dtype on the fastest device at hand: building the 1.24 B-parameter `rag` model through
`LlamaForCausalLM(config)` would first fill 5 GB of float32 on the CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbatch.bench.fp8_block import (
    block_size_for,
    fp8_block_quantization_config,
    quantize_fp8_block,
)
from kvbatch.bench.rtn_w4a16 import gptq_quantization_config, quantize_rtn
from kvbatch.bench.workloads import WEIGHT_FORMATS
from kvbatch.engine.quant.mxfp4_pack import MXFP4_QUANTIZATION_CONFIG

CACHE_ENV = "KVBATCH_CACHE"


ARCHITECTURES = ("llama", "qwen3", "gpt-oss")
"""A dense spec's architecture: Llama, or Qwen3 (RMSNorm over each head of q and k before
RoPE, an explicit head_dim, no q/k/v bias). A spec with experts is Qwen3-MoE, unless it is
gpt-oss (sinks, alternating 128-token windows, YaRN, biased experts, `weights="mxfp4"`)."""

GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""gpt-oss-20b's and -120b's RoPE, as their config.json."""

MXFP4_RANDOM_SCALE = 120
"""E8M0 exponent of the random MXFP4 experts: 2 ** -7 times E2M1 codes (RMS about 2.9) gives
weights of RMS about 0.023, transformers' initialisation's 0.02."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder shape; `config()` turns it into a transformers config: LlamaConfig,
    Qwen3Config (`architecture="qwen3"`) or, with experts, Qwen3MoeConfig."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    rope_theta: float = 500000.0
    # Llama 3.x frequency scaling (None: plain RoPE)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)
    initializer_range: float = 0.02
    dtype: str = "bfloat16"  # what the safetensors hold
    seed: int = 0
    # "float", "w4a16" (the decoder linears rounded to 4 bits, benchmarks/rtn_w4a16.py) or
    # "fp8-block" (FP8 with a scale per 128 x 128 tile, benchmarks/fp8_block.py)
    weights: str = "float"
    # Qwen3-MoE when num_experts > 0: every layer's MLP is num_experts experts of
    # moe_intermediate_size, num_experts_per_tok of them per token (renormalised)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    explicit_head_dim: int | None = None  # None: hidden_size // num_attention_heads
    architecture: str = "llama"  # of a dense spec (ARCHITECTURES)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"model {self.name!r}: weights must be one of {', '.join(WEIGHT_FORMATS)}, "
                f"got {self.weights!r}"
            )
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"model {self.name!r}: architecture must be one of {', '.join(ARCHITECTURES)}, "
                f"got {self.architecture!r}"
            )
        if self.architecture == "gpt-oss":
            if not self.is_moe:
                raise ValueError(f"model {self.name!r}: gpt-oss needs its experts")
        elif self.is_moe and self.architecture != "llama":
            # the experts alone make a spec Qwen3-MoE; `architecture` is a dense spec's
            raise ValueError(f"model {self.name!r}: a spec with experts is Qwen3-MoE already")
        if self.weights == "mxfp4" and self.architecture != "gpt-oss":
            raise ValueError(f"model {self.name!r}: mxfp4 weights are gpt-oss's experts")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_qk_norm(self) -> bool:
        """Qwen3, dense or MoE: an RMSNorm weight of head_dim for q and one for k per layer."""
        return (self.is_moe and self.architecture == "llama") or self.architecture == "qwen3"

    def config(self):
        """The transformers config of this shape, LlamaConfig, Qwen3Config or (with experts)
        Qwen3MoeConfig (no BOS/EOS: prompts are raw token ids)."""
        from transformers import GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

        kwargs: dict[str, Any] = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
            rms_norm_eps=1e-5,
            hidden_act="silu",
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        )
        if self.architecture == "gpt-oss":
            kwargs.pop("hidden_act")
            return GptOssConfig(
                **kwargs,
                num_local_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                sliding_window=128,
                rope_parameters=dict(GPT_OSS_ROPE),
            )  # layers alternate sliding and full, as GptOssConfig lays them out
        if self.is_moe:
            return Qwen3MoeConfig(
                **kwargs,
                rope_theta=self.rope_theta,
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        if self.architecture == "qwen3":  # Qwen3-8B's own config has no q/k/v bias either
            kwargs.update(attention_bias=False, use_sliding_window=False)
        config_class = Qwen3Config if self.architecture == "qwen3" else LlamaConfig
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        try:  # transformers 5 reads RoPE settings from `rope_parameters`
            config = config_class(**kwargs, rope_parameters=rope)
        except TypeError:  # older releases: rope_theta + rope_scaling
            scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
            config = config_class(**kwargs, rope_theta=self.rope_theta, rope_scaling=scaling)
        return config

    def num_parameters(self) -> int:
        h, f, v, n = (
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.num_hidden_layers,
        )
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        heads = self.num_attention_heads
        mlp = 3 * h * f
        if self.is_moe:
            mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts, router
        per_layer = h * q * 2 + h * kv * 2 + mlp + 2 * h
        if self.architecture == "gpt-oss":  # biases everywhere, sinks, experts of f
            e = self.num_experts
            experts = e * (3 * h * f + 2 * f + h) + e * (h + 1)  # weights, biases, router
            per_layer = h * q * 2 + h * kv * 2 + (q + h) + 2 * kv + heads + experts + 2 * h
        if self.has_qk_norm:
            per_layer += 2 * self.head_dim
        return v * h * (1 if self.tie_word_embeddings else 2) + n * per_layer + h

    def key(self) -> str:
        """A short digest of every field: a changed shape never reuses an old folder."""
        fields = dataclasses.asdict(self)
        for name in _LATER_FIELDS:  # at their defaults, the shapes made before keep their keys
            if fields[name] == _DEFAULTS[name]:
                del fields[name]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


_LATER_FIELDS = (
    "weights",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "explicit_head_dim",
    "architecture",
)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelSpec)}

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

LLAMA_3_2_1B = ModelSpec(
    name="llama-3.2-1b-random",
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_scaling=LLAMA3_ROPE_SCALING,
)
"""Llama-3.2-1B's shape (1.24 B parameters, tied embeddings), random weights."""

TINY_LLAMA = ModelSpec(
    name="llama-tiny-random",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=4096,
    rope_scaling={**LLAMA3_ROPE_SCALING, "original_max_position_embeddings": 512},
    # larger than transformers' 0.02 so greedy decoding is decisive on a tiny model
    initializer_range=0.1,
    dtype="float32",
)
"""The same architecture shrunk so `--tiny` runs on the CPU in seconds."""

LLAMA_3_1_8B_8_LAYERS = ModelSpec(
    name="llama-3.1-8b-8-layers-random",
    hidden_size=4096,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    rope_scaling=LLAMA3_ROPE_SCALING,
)
"""Llama-3.1-8B's layer shapes, 8 of its 32 layers (2.8 B parameters), random weights: each
decode step reads the same GEMM shapes as the 8B model, a quarter of them, so the weights'
bytes per step (what a memory-bound step waits on) compare between formats as in the 8B."""

QWEN3_30B_A3B_4_LAYERS = ModelSpec(
    name="qwen3-30b-a3b-4-layers-random",
    hidden_size=2048,
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    explicit_head_dim=128,
    intermediate_size=6144,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
)
"""Qwen3-30B-A3B's layer shapes (128 experts of 768, top 8; 32 query and 4 KV heads of 128),
4 of its 48 layers (3.1 B parameters), random weights: `rag-moe`'s model."""

TINY_QWEN3_MOE = ModelSpec(
    name="qwen3-moe-tiny-random",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    vocab_size=512,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
    initializer_range=0.1,
    dtype="float32",
)
"""The same architecture shrunk, for `rag-moe --tiny` and the MoE greedy check."""

QWEN3_8B_8_LAYERS = ModelSpec(
    name="qwen3-8b-8-layers-random",
    architecture="qwen3",
    hidden_size=4096,
    num_hidden_layers=8,
    num_attention_heads=32,
    num_key_value_heads=8,
    explicit_head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
)
"""Qwen3-8B's layer shapes (32 query and 8 KV heads of 128, q/k RMSNorm, MLP of 12288, vocab
151,936, untied), 8 of its 36 layers (2.8 B parameters), random weights: `rag-qwen3`'s model.
Every per-layer GEMM and attention shape is the 8B's, so the dense path runs at a realistic
size, while the weights (5.6 GB in bfloat16, not 16) are drawn, written and loaded twice, by
kvbatch and by transformers, inside the device time a check gets."""

TINY_QWEN3 = ModelSpec(
    name="qwen3-tiny-random",
    architecture="qwen3",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    # wider than hidden_size // heads, as in the small Qwen3s: a head_dim taken from the
    # hidden size instead of the config would not load
    explicit_head_dim=32,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_theta=1000000.0,
    initializer_range=0.1,
    dtype="float32",
)
"""Dense Qwen3 shrunk, for `rag-qwen3 --tiny`."""

GPT_OSS_20B_4_LAYERS = ModelSpec(
    name="gpt-oss-20b-4-layers-random",
    architecture="gpt-oss",
    hidden_size=2880,
    num_hidden_layers=4,
    num_attention_heads=64,
    num_key_value_heads=8,
    explicit_head_dim=64,
    intermediate_size=2880,
    num_experts=32,
    num_experts_per_tok=4,
    vocab_size=201088,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    rope_theta=150000.0,
    weights="mxfp4",
)
"""gpt-oss-20b's layer shapes (64 query and 8 KV heads of 64, hidden 2,880, 32 experts of
2,880, top 4, MXFP4 experts as published), 4 of its 24 layers, random weights: `rag-gpt-oss`'s
model (experts 1.7 GB in MXFP4; transformers dequantizes them to 6.4 GB of bfloat16)."""

TINY_GPT_OSS = ModelSpec(
    name="gpt-oss-tiny-random",
    architecture="gpt-oss",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    explicit_head_dim=16,
    intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    rope_theta=150000.0,
    initializer_range=0.1,
    dtype="float32",
    weights="mxfp4",
)
"""gpt-oss shrunk (MXFP4 experts), for `rag-gpt-oss --tiny` on the CPU."""

MODEL_SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        LLAMA_3_2_1B,
        LLAMA_3_1_8B_8_LAYERS,
        QWEN3_30B_A3B_4_LAYERS,
        QWEN3_8B_8_LAYERS,
        TINY_LLAMA,
        TINY_QWEN3_MOE,
        TINY_QWEN3,
        GPT_OSS_20B_4_LAYERS,
        TINY_GPT_OSS,
    )
}


def random_weights(spec: ModelSpec, device: str | torch.device | None = None) -> dict[str, Any]:
    """The state dict of `spec` with seeded random weights, on the CPU in `spec.dtype`.

    Names and shapes come from transformers' own module tree (built on the meta device, so
    nothing is allocated). The draw is done on `device` (default: CUDA when present): the
    same seed gives the same weights on the same kind of device.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(spec.config())
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(spec.dtype)
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    weights = {}
    for name, meta in shell.state_dict().items():
        if spec.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: the checkpoint holds the embedding once, as real Llama 3.2 does
        if spec.weights == "mxfp4" and name.endswith(MXFP4_PROJECTIONS):
            weights.update(random_mxfp4(name, meta.shape, gen, device))
            continue
        if name.endswith("norm.weight"):
            t = torch.ones(meta.shape, dtype=dtype, device=device)
        else:
            t = torch.empty(meta.shape, dtype=torch.float32, device=device)
            t.normal_(0.0, spec.initializer_range, generator=gen)
            t = t.to(dtype)
        weights[name] = t.cpu().contiguous()
    return weights


MXFP4_PROJECTIONS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def random_mxfp4(
    name: str, shape: torch.Size, gen: torch.Generator, device: torch.device
) -> dict[str, torch.Tensor]:
    """A stacked expert projection of transformers' shape [E, in, out] drawn directly as
    published MXFP4 tensors (random E2M1 codes, one exponent for all): no float copy of the
    experts is ever made, so gpt-oss-sized experts build in seconds."""
    e, k, n = shape
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, device=device)
    scales = torch.full((e, n, k // 32), MXFP4_RANDOM_SCALE, dtype=torch.uint8)
    return {
        f"{name}_blocks": blocks.to(torch.uint8).cpu().contiguous(),
        f"{name}_scales": scales,
    }


def random_model_dir(
    spec: ModelSpec | str, cache_dir: str | Path | None = None, weights: str | None = None
) -> Path:
    """The folder of `spec`'s random model, built on first use and cached (no network);
    `weights` ("float", "w4a16", "fp8-block") overrides the spec's format."""
    if isinstance(spec, str):
        try:
            spec = MODEL_SPECS[spec]
        except KeyError:
            raise ValueError(f"unknown model {spec!r}; known: {', '.join(MODEL_SPECS)}") from None
    if weights is not None:
        spec = dataclasses.replace(spec, weights=weights)
    dest = _cache_root(cache_dir) / "random-models" / f"{spec.name}-{spec.key()}"
    return build_once(dest, _complete, lambda tmp: build_random_model(spec, tmp))


def build_once(
    dest: Path, complete: Callable[[Path], bool], write: Callable[[Path], object]
) -> Path:
    """`dest`, written by `write` on first use: into a temporary folder beside it, then
    renamed, so an interrupted build is never taken for a finished one and two processes
    building at once leave one (`complete` says whether a folder is finished)."""
    if complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first
            if not complete(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_random_model(spec: ModelSpec, folder: str | Path) -> Path:
    """Write `spec` with random weights into `folder` (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = spec.config()
    config.dtype = spec.dtype
    weights = random_weights(spec)
    if spec.weights == "w4a16":
        config.quantization_config = gptq_quantization_config()
        weights = quantize_rtn(weights)
    elif spec.weights == "mxfp4":  # the experts were drawn packed (random_weights)
        config.quantization_config = dict(MXFP4_QUANTIZATION_CONFIG)
    elif spec.weights == "fp8-block":
        dims = [spec.hidden_size, spec.intermediate_size, spec.moe_intermediate_size]
        block = block_size_for([d for d in dims if d] + [spec.head_dim])
        config.quantization_config = fp8_block_quantization_config(block)
        weights = quantize_fp8_block(weights, block)
    config.save_pretrained(str(folder))
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "kvbatch-spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2))
    return folder


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in ("config.json", "model.safetensors"))


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvbatch"


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]

"""Engine settings: one small frozen dataclass per part, validated on construction. Their
defaults are EngineArgs' (args.py), where each setting is written once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbatch.engine.core.args import (
    CPU_BATCHED_TOKENS,
    CUDA_BATCHED_TOKENS,
    CUDA_LONG_PREFILL_STEP_RATIO,
    DEFAULTS,
    EngineArgs,
)
from kvbatch.engine.core.args import DEFAULT_CPU_KV_BYTES as DEFAULT_CPU_KV_BYTES
from kvbatch.engine.core.spec_config import SpecConfig as SpecConfig
from kvbatch.engine.quant.detect import ONLINE_METHODS as ONLINE_QUANTIZATION

# kv_cache_dtype values (vLLM's names): "auto" keeps K/V in the model's dtype; "fp8" stores
# them in E4M3 with a per-layer scale (engine/attention/kv_scales.py), half of bfloat16's bytes.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULTS.block_size
    enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching
    sliding_window_kv: bool = DEFAULTS.sliding_window_kv  # window layers free old blocks
    kv_cache_memory_fraction: float = DEFAULTS.kv_cache_memory_fraction  # CUDA: share of free
    kv_cache_bytes: int | None = DEFAULTS.kv_cache_bytes  # CPU: byte budget; CUDA: overrides
    num_kv_blocks: int | None = DEFAULTS.num_kv_blocks  # exact pool size, over both budgets
    kv_cache_dtype: str = DEFAULTS.kv_cache_dtype  # "auto": the model's dtype; "fp8": E4M3

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; choose "
                + ", ".join(KV_CACHE_DTYPES)
                + " (fp8 is E4M3; fp8_e5m2 is not offered)"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool's element dtype: the model's for "auto", E4M3 for "fp8"."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_num_batched_tokens: int | None = DEFAULTS.max_num_batched_tokens  # None: by device
    max_model_len: int = 0  # filled in by the engine from the model (0 = the model's context)
    # With max_model_len 0: the longest request the caller will send (0 = unknown), the
    # context the engine picks in place of the model's own (kv/sizing.py chosen_context_len)
    longest_request: int = 0
    # While other sequences decode, one prompt's chunk in a step is at most this many tokens
    # (0 = no cap): a 32k-token prompt then costs running requests several short waits for
    # their next token instead of a few long ones. Prompts shorter than this are unaffected.
    long_prefill_token_threshold: int = DEFAULTS.long_prefill_token_threshold
    # The context length at which one prompt token's attention costs as much as its matmuls
    # (None = the engine reads it off the model, ModelConfig.attention_break_even_context;
    # 0 = count tokens only). With it, the cap above is in tokens' worth of compute: a token
    # at context x costs (1 + x / this) plain tokens, so chunks late in a 32k prompt are
    # shorter and every step that carries one takes about as long.
    attention_break_even_context: int | None = None
    # While other sequences decode, a step that carries a chunk of a prompt longer than the
    # threshold above takes at most this many plain decode steps' time: the engine times its
    # steps and sizes such chunks to fit (engine/sched/step_cost.py). None = auto: 2.5 on CUDA, off
    # on the CPU; 0 = off (chunks by the token cap alone, the same on every run: with timing,
    # chunk boundaries follow the measured times, so in half precision a rerun may break a
    # near tie differently).
    long_prefill_step_ratio: float | None = DEFAULTS.long_prefill_step_ratio

    def __post_init__(self) -> None:
        ratio = self.long_prefill_step_ratio
        if ratio is not None and ratio != 0 and not ratio > 1:
            raise ValueError(
                "long_prefill_step_ratio must be > 1 (plain decode steps' time a step with a "
                f"long prompt's chunk may take) or 0 (off), got {ratio}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = no cap), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.attention_break_even_context is not None and self.attention_break_even_context < 0:
            raise ValueError(
                "attention_break_even_context must be >= 0 (0 = count tokens only), got "
                f"{self.attention_break_even_context}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.longest_request < 0:
            raise ValueError(f"longest_request must be >= 1, got {self.longest_request}")


def default_batched_tokens(device: torch.device) -> int:
    """Tokens per step when the user sets none. On the CPU smaller steps keep the activations
    in cache (4096 beat 8192 on SmolLM2); GPUs want big steps."""
    return CUDA_BATCHED_TOKENS if device.type == "cuda" else CPU_BATCHED_TOKENS


def default_long_prefill_step_ratio(device: torch.device) -> float:
    """On CUDA decoders' latency is worth a timed chunk size; on the CPU chunks keep the token
    cap (the same split on every run), unless a ratio is asked for."""
    return CUDA_LONG_PREFILL_STEP_RATIO if device.type == "cuda" else 0.0


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = DEFAULTS.device
    dtype: str = DEFAULTS.dtype
    attention_backend: str = DEFAULTS.attention_backend
    cascade_attention: bool = DEFAULTS.cascade_attention  # prefix blocks read once per group
    cuda_graphs: bool = DEFAULTS.cuda_graphs  # CUDA + triton: decode steps replay graphs
    # ... and so do decode steps with one prompt chunk of up to this many tokens (a long
    # prompt's short chunks beside running decodes); 0: decode steps only
    cuda_graph_max_chunk: int = DEFAULTS.cuda_graph_max_chunk
    # Queue each step before the previous one's tokens reach the host (engine/core/llm_engine.py);
    # None = on for CUDA (off with speculative decoding), off on the CPU, where it gains nothing.
    async_scheduling: bool | None = DEFAULTS.async_scheduling
    # Freeze the heap the engine starts with, out of the cycle collector's full passes
    # (engine/core/startup_heap.py); None = on CUDA, where one pass stalls many steps.
    freeze_gc: bool | None = DEFAULTS.freeze_gc
    seed: int = DEFAULTS.seed
    # Online quantization of a float checkpoint at load ("fp8", vLLM's name); None: the
    # checkpoint's own (config.json's quantization_config) or none. engine/quant/detect.py.
    quantization: str | None = DEFAULTS.quantization
    # How answers split into reasoning and content (engine/reasoning); None: from the model.
    reasoning_parser: str | None = DEFAULTS.reasoning_parser
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpecConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in ONLINE_QUANTIZATION:
            raise ValueError(
                f"quantization={self.quantization!r} is not supported; choose "
                f"{', '.join(ONLINE_QUANTIZATION)} or None (pre-quantized checkpoints need no "
                "option: their config.json says how they are quantized)"
            )
        if self.cuda_graph_max_chunk < 0:
            raise ValueError(
                f"cuda_graph_max_chunk must be >= 0 (0: no graphs for steps with a prompt "
                f"chunk), got {self.cuda_graph_max_chunk}"
            )

    @classmethod
    def from_args(cls, model: str, args: EngineArgs) -> EngineConfig:
        """The engine's configuration of `model` (a local path) with the settings `args`."""
        return cls(
            model=model,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            cascade_attention=args.cascade_attention,
            cuda_graphs=args.cuda_graphs,
            cuda_graph_max_chunk=args.cuda_graph_max_chunk,
            async_scheduling=args.async_scheduling,
            freeze_gc=args.freeze_gc,
            seed=args.seed,
            quantization=args.quantization,
            reasoning_parser=args.reasoning_parser,
            cache=CacheConfig(
                block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching,
                sliding_window_kv=args.sliding_window_kv,
                kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                kv_cache_bytes=args.kv_cache_bytes,
                num_kv_blocks=args.num_kv_blocks,
                kv_cache_dtype=args.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len or 0,
                longest_request=args.longest_request or 0,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                long_prefill_step_ratio=args.long_prefill_step_ratio,
            ),
            speculative=SpecConfig.parse(args.speculative, args.num_speculative_tokens),
        )

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device {self.device!r} is not valid (try 'cpu' or 'cuda')") from e
        if device.type == "cuda" and not torch.cuda.is_available():
            why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible to it"
            raise ValueError(
                f"device {self.device!r}: torch {torch.__version__} is {why}; use --device cpu, "
                "or install torch's CUDA build (docs/GETTING_STARTED.md)"
            )
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """float32 on the CPU; bfloat16 on CUDA unless asked otherwise."""
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        names = {
            "float32": torch.float32,
            "float": torch.float32,
            "float16": torch.float16,
            "half": torch.float16,
            "bfloat16": torch.bfloat16,
        }
        if self.dtype not in names:
            raise ValueError(
                f"dtype {self.dtype!r} is not supported; choose auto, float32, float16 or bfloat16"
            )
        return names[self.dtype]

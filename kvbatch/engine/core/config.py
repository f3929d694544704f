"""Engine settings: one small frozen dataclass per part, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvbatch.engine.quant.detect import ONLINE_METHODS as ONLINE_QUANTIZATION

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in float32

# kv_cache_dtype values (vLLM's names): "auto" keeps K/V in the model's dtype; "fp8" stores
# them in E4M3 with a per-layer scale (engine/attention/kv_scales.py), half of bfloat16's bytes.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_fraction: float = 0.90  # CUDA: share of free memory given to the KV pool
    kv_cache_bytes: int | None = None  # CPU: byte budget (default 1 GiB); CUDA: overrides
    num_kv_blocks: int | None = None  # exact pool size, overrides both budgets
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": E4M3 with scales

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
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None = auto: 8192 on CUDA, 4096 on the CPU
    max_model_len: int = 0  # filled in by the engine from the model (0 = the model's context)
    # While other sequences decode, one prompt's chunk in a step is at most this many tokens
    # (0 = no cap): a 32k-token prompt then costs running requests several short waits for
    # their next token instead of a few long ones. Prompts shorter than this are unaffected.
    long_prefill_token_threshold: int = 2048
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
    long_prefill_step_ratio: float | None = None

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


SPEC_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: who proposes tokens, how many, and when it switches itself off.

    `method` "ngram" looks the sequence's last tokens up in its own prompt and output; "draft"
    runs `draft_model` (a checkpoint with the target's vocabulary). Speculation is decided per
    sequence and per step: a sequence whose acceptance (an EWMA of accepted / proposed) falls
    below `min_acceptance` decodes normally for `backoff_steps` steps, then tries again; the
    acceptance a sequence needs grows with the step's decode batch (to `large_batch_acceptance`
    at `max_batch_size`), since verification costs more there; and no sequence speculates in a
    step whose decode batch is larger than `max_batch_size` (the step is compute-bound there,
    and verifying k extra tokens per sequence costs more than it saves).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    ngram_min: int = 2  # shortest n-gram looked up
    ngram_max: int = 4  # longest n-gram looked up (longest match wins)
    min_acceptance: float = 0.25  # needed at batch 1; backoff below it
    large_batch_acceptance: float = 0.6  # needed at max_batch_size (linear in between)
    acceptance_decay: float = 0.5  # EWMA weight of the newest step's acceptance
    backoff_steps: int = 16
    # Decodes per step above which nobody speculates: verification pays at small batches and
    # stops paying near 32 (`kvbatch bench spec-copy`; docs/BENCHMARKS.md), so 16 keeps a
    # large batch as fast as without speculation.
    max_batch_size: int = 16

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not known; use 'ngram' or 'draft:PATH'"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs a draft model: 'draft:PATH'")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("draft_model is only used with method 'draft'")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if not 0.0 <= self.large_batch_acceptance <= 1.0:
            raise ValueError(
                f"large_batch_acceptance must be in [0, 1], got {self.large_batch_acceptance}"
            )
        if not 0.0 < self.acceptance_decay <= 1.0:
            raise ValueError(f"acceptance_decay must be in (0, 1], got {self.acceptance_decay}")
        if self.backoff_steps < 0:
            raise ValueError(f"backoff_steps must be >= 0, got {self.backoff_steps}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    @classmethod
    def parse(
        cls, value: str | SpecConfig | None, num_speculative_tokens: int | None = None
    ) -> SpecConfig | None:
        """`"ngram"`, `"draft:PATH"`, a SpecConfig or None (off); `num_speculative_tokens`
        overrides k when given."""
        if value is None:
            if num_speculative_tokens is not None:
                raise ValueError("num_speculative_tokens needs speculative='ngram' or 'draft:PATH'")
            return None
        if isinstance(value, SpecConfig):
            config = value
        elif isinstance(value, str):
            method, _, path = value.partition(":")
            if method == "ngram" and not path:
                config = cls("ngram")
            elif method == "draft" and path:
                config = cls("draft", draft_model=path)
            else:
                raise ValueError(
                    f"speculative={value!r}: expected 'ngram' or 'draft:PATH' "
                    "(PATH a Hugging Face folder or .gguf with the target's vocabulary)"
                )
        else:
            raise ValueError(
                f"speculative must be None, 'ngram', 'draft:PATH' or a SpecConfig, "
                f"not {type(value).__name__}"
            )
        if num_speculative_tokens is not None:
            config = dataclasses.replace(config, num_speculative_tokens=num_speculative_tokens)
        return config


def default_batched_tokens(device: torch.device) -> int:
    """Tokens per step when the user sets none. On the CPU smaller steps keep the activations
    in cache (4096 beat 8192 on SmolLM2); GPUs want big steps."""
    return 8192 if device.type == "cuda" else 4096


CUDA_LONG_PREFILL_STEP_RATIO = 2.5  # under the target of 3 decode steps, for the gaps' jitter


def default_long_prefill_step_ratio(device: torch.device) -> float:
    """On CUDA decoders' latency is worth a timed chunk size; on the CPU chunks keep the token
    cap (the same split on every run), unless a ratio is asked for."""
    return CUDA_LONG_PREFILL_STEP_RATIO if device.type == "cuda" else 0.0


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    cascade_attention: bool = True  # decodes sharing prefix blocks read them once per group
    cuda_graphs: bool = True  # CUDA + triton: decode steps replay captured graphs
    # ... and so do decode steps with one prompt chunk of up to this many tokens (a long
    # prompt's short chunks beside running decodes); 0: decode steps only
    cuda_graph_max_chunk: int = 512
    # Queue each step before the previous one's tokens reach the host (engine/core/llm_engine.py);
    # None = on for CUDA (off with speculative decoding), off on the CPU, where it gains nothing.
    async_scheduling: bool | None = None
    # Freeze the heap the engine starts with, out of the cycle collector's full passes
    # (engine/core/startup_heap.py); None = on CUDA, where one pass stalls many steps.
    freeze_gc: bool | None = None
    seed: int = 0
    # Online quantization of a float checkpoint at load ("fp8", vLLM's name); None: the
    # checkpoint's own (config.json's quantization_config) or none. engine/quant/detect.py.
    quantization: str | None = None
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

"""The engine's settings as command-line flags: `kvbatch run`, `generate` and `worker` share them,
and `kvbatch bench` shares the GPU tuning ones.

Each flag maps to one `engine.LLM` keyword. A flag left out is left out of the keywords too, so
the engine's own default applies (several depend on the device: CUDA graphs, async scheduling
and timed chunks are on for CUDA only). Values are checked here, where the error can name the
flag, before a model is loaded or a broker is reached. This module imports no torch: `kvbatch
status` builds the same parser.
"""

from __future__ import annotations

import argparse
import re

from kvbatch.jobs.openai_format.tool_parsers import PARSERS

QUANTIZATION_CHOICES = ("fp8",)  # engine/quant/detect.py's ONLINE_METHODS (no torch here)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """'4GiB', '4G', '512M', '1.5g' or plain bytes -> bytes (binary units, as torch reports
    memory)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give e.g. 4GiB, 512M or bytes")
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be above 0 bytes, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A share of memory in (0, 1]."""
    value = _number(text, float)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (e.g. 0.9), got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two (e.g. 16), got {text}")
    return value


def step_ratio(text: str) -> float:
    """Plain decode steps' time a step with a long prompt's chunk may take: > 1, or 0 (off)."""
    value = _number(text, float)
    if value != 0 and not value > 1:
        raise argparse.ArgumentTypeError(f"must be above 1, or 0 to turn it off, got {text}")
    return value


def _number(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None


def add_gpu_tuning_args(group) -> None:
    """The throughput/latency knobs of a GPU run (default None: the engine's default)."""
    group.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8", "fp8_e4m3"),
        default=None,
        help="auto: K/V in the model's dtype; fp8: E4M3 with per-layer scales (the "
        "checkpoint's kv_cache_scheme, else 1.0), twice bfloat16's tokens in the same memory",
    )
    group.add_argument(
        "--kv-cache-memory-fraction",
        type=fraction,
        metavar="F",
        help="CUDA: share of the memory left after the weights and the largest step's "
        "activations that the KV pool takes (the engine's default: 0.90; unlike vLLM's "
        "--gpu-memory-utilization, not a share of the whole GPU)",
    )
    group.add_argument(
        "--long-prefill-token-threshold",
        type=non_negative_int,
        metavar="N",
        help="while others decode, a prompt's chunk costs at most N tokens' worth of compute "
        "(the engine's default: 2048; 0 = no cap)",
    )
    group.add_argument(
        "--long-prefill-step-ratio",
        type=step_ratio,
        metavar="R",
        help="while others decode, a step with a longer prompt's chunk takes at most R plain "
        "decode steps' time, the engine timing its steps (default: 2.5 on CUDA, off on the "
        "CPU; 0 = off)",
    )
    group.add_argument(
        "--cuda-graph-max-chunk",
        type=non_negative_int,
        metavar="N",
        help="decode steps with one prompt chunk of up to N tokens replay CUDA graphs "
        "(default: 512; 0 = decode steps only)",
    )
    group.add_argument(
        "--enforce-eager",
        dest="cuda_graphs",
        action="store_false",
        default=None,
        help="CUDA: run every step eagerly, capturing no CUDA graphs (less memory and a "
        "quicker start; slower decoding)",
    )


def add_revision_arg(parser: argparse.ArgumentParser) -> None:
    """`--revision` of a Hub id given as --model (kvbatch.hub)."""
    parser.add_argument(
        "--revision",
        default=None,
        metavar="REV",
        help="with a Hub id as --model: the branch, tag or commit to fetch (default: main)",
    )


def add_tool_call_parser_arg(parser: argparse.ArgumentParser) -> None:
    """`--tool-call-parser` of a job (`run`, `submit`), as vLLM's: how chat answers with
    tool_choice "auto" are read for tool calls. Job-level, because it belongs to the model."""
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="read tool calls out of chat answers with tool_choice 'auto' (the default when a "
        "line gives tools) in this model's format: hermes for Qwen2.5/Qwen3 and Hermes models; "
        "without it such lines are refused (named and 'required' tool_choice need no parser)",
    )


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by the commands that run a model."""
    add_revision_arg(parser)
    parser.add_argument(
        "--device",
        default="auto",
        metavar="auto|cpu|cuda|cuda:N",
        help="where the model runs (default auto: the first CUDA GPU if there is one, else the "
        "CPU)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        metavar="auto|bfloat16|float16|float32",
        help="weights' and activations' type (default auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="CPU threads for torch's operators (default: OMP_NUM_THREADS when set, else the "
        "cores this process may use divided by KVBATCH_LOCAL_WORKERS, the kvbatch workers on "
        "this machine, default 1, and no more than the cores idle at start; more threads than "
        "free cores makes CPU runs many times slower)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=256,
        metavar="N",
        help="requests decoded together in one engine step at most (default 256)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per engine step (default: 8192 on CUDA, 4096 on the CPU)",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="longest prompt + answer in tokens; a longer request fails alone (default: the "
        "model's context length)",
    )
    parser.add_argument(
        "--block-size",
        type=power_of_two,
        default=16,
        metavar="N",
        help="tokens per KV-cache block, a power of two; prefixes are shared in whole blocks "
        "(default 16)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV of prompt prefixes that earlier requests computed",
    )
    parser.add_argument(
        "--attention-backend",
        default="auto",
        metavar="auto|torch|triton",
        help="attention kernels: triton (GPU), torch (reference, CPU and GPU); default auto: "
        "triton on CUDA, torch on the CPU",
    )
    parser.add_argument(
        "--speculative",
        default=None,
        metavar="ngram|draft:PATH",
        help="speculative decoding: n-gram prompt lookup, or a draft model with the same "
        "vocabulary (default: off)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=None,
        metavar="K",
        help="tokens proposed per step with --speculative (default 4)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="quantize a float checkpoint at load: fp8 (FP8 weights with per-channel scales, "
        "activations per token; embeddings and lm_head kept). Quantized checkpoints "
        "(compressed-tensors, fp8, GPTQ, AWQ) are detected from their config.json without it",
    )
    memory = parser.add_argument_group("KV cache and GPU tuning (defaults: the engine's)")
    memory.add_argument(
        "--kv-cache-bytes",
        type=byte_size,
        metavar="SIZE",
        help="the KV pool's size, e.g. 4GiB: the CPU's budget (default 1GiB); on CUDA it "
        "replaces --kv-cache-memory-fraction",
    )
    add_gpu_tuning_args(memory)
    memory.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step while the GPU runs this one (default: on CUDA, unless "
        "--speculative)",
    )
    memory.add_argument(
        "--no-cascade-attention",
        dest="cascade_attention",
        action="store_false",
        default=None,
        help="shared-prefix (cascade) attention off: each running request reads a prefix it "
        "shares with others on its own",
    )


def engine_args_conflict(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of engine flags, or None (each value alone is checked
    by its type)."""
    if getattr(args, "async_scheduling", None) and getattr(args, "speculative", None):
        return (
            "--async-scheduling cannot go with --speculative: speculation proposes from each "
            "step's tokens before the next step is queued (drop one)"
        )
    return None


# engine.LLM keywords taken from the flag of the same name only when it was given
_OPTIONAL = (
    "kv_cache_bytes",
    "kv_cache_memory_fraction",
    "kv_cache_dtype",
    "long_prefill_token_threshold",
    "long_prefill_step_ratio",
    "cuda_graph_max_chunk",
    "cuda_graphs",
    "async_scheduling",
    "cascade_attention",
    "quantization",
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The `engine.LLM` keywords of parsed engine flags (add_engine_args)."""
    kwargs = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    kwargs.update((k, getattr(args, k)) for k in _OPTIONAL if getattr(args, k) is not None)
    if getattr(args, "revision", None) is not None:  # a Hub id's branch, tag or commit
        kwargs["revision"] = args.revision
    return kwargs

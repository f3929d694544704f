"""`EngineArgs`: every engine setting written once, as vLLM's EngineArgs is: its name (the `LLM`
keyword), type, default, help and command-line flag. The rest is generated from it:

- `LLM(model, **settings)` takes exactly these fields (`EngineKwargs` types them for editors);
- the engine's config dataclasses (config.py) take their defaults from `DEFAULTS`;
- `kvbatch run`, `generate` and `worker` build their flags, help and range checks from the
  fields' `Flag` (kvbatch/engine_args.py), and `kvbatch bench` shares the GPU ones;
- docs/ENGINE.md's settings table is `settings_table()`.

A default that depends on the device is None here (the engine decides once it knows the
device) and its field says in words what it becomes (`shown`). Plain Python, no torch: `kvbatch
status` builds the same flags without loading the engine.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from kvbatch.engine.core.arg_values import (
    byte_size,
    fraction,
    non_negative_int,
    positive_int,
    power_of_two,
    step_ratio,
)
from kvbatch.engine.core.spec_config import SpecConfig
from kvbatch.engine.reasoning.registry import PARSER_CHOICES as REASONING_PARSER_CHOICES

# The numbers behind the device-dependent defaults (config.py applies them to a device).
CUDA_BATCHED_TOKENS = 8192  # GPUs want big steps
CPU_BATCHED_TOKENS = 4096  # smaller steps keep the activations in cache
CUDA_LONG_PREFILL_STEP_RATIO = 2.5  # under the target of 3 decode steps, for the gaps' jitter
DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in float32

KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; config.py maps them to torch's
QUANTIZATION_CHOICES = ("fp8",)  # engine/quant/detect.py's ONLINE_METHODS (no torch here)

FlagGroup = Literal["model", "engine", "memory", "gpu"]


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the command line.

    `group` "engine": the flag's default is the setting's, and its value is passed unless None;
    "model": the same, for the flags `kvbatch submit` takes too (--revision); "memory" and
    "gpu" (the KV cache and GPU tuning group; `kvbatch bench` shares "gpu"): the flag defaults
    to None and is passed only when given, so the engine's default applies, device-dependent
    ones included. A `negates` flag is a switch that sets the setting False
    (--no-prefix-caching); `both` gives --name and --no-name.
    """

    group: FlagGroup = "engine"
    name: str | None = None  # default: --the-field-name
    type: Callable[[str], Any] | None = None  # reads the text and checks its range
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    negates: bool = False
    both: bool = False
    help: str | None = None  # a switch's own wording; default: the setting's help

    def option(self, setting: str) -> str:
        return self.name or "--" + setting.replace("_", "-")


def _setting(default: Any, help: str, *, shown: str | None = None, flag: Flag | None = None):
    """A field of EngineArgs: its default, what it sets, its default in words when that is None
    or depends on the device (`shown`), and its flag (None: a Python-only keyword)."""
    return field(default=default, metadata={"help": help, "shown": shown, "flag": flag})


@dataclass(frozen=True)
class EngineArgs:
    """The engine's settings, as `LLM` takes them after the model."""

    revision: str | None = _setting(
        None,
        "with a Hub id as the model: the branch, tag or commit to fetch",
        shown="main",
        flag=Flag(group="model", metavar="REV"),
    )
    reasoning_parser: str | None = _setting(
        None,
        "how a reasoning model's answers split into reasoning_content and content (and where a "
        "JSON schema's grammar starts): openai_gptoss (harmony), qwen3 or deepseek_r1 "
        "(<think>), none (off)",
        shown="chosen from the model's tokenizer and chat template",
        flag=Flag(group="model", choices=REASONING_PARSER_CHOICES),
    )
    device: str = _setting(
        "auto",
        "where the model runs: auto (the first CUDA GPU if there is one, else the CPU), cpu, "
        "cuda or cuda:N",
        flag=Flag(metavar="auto|cpu|cuda|cuda:N"),
    )
    dtype: str = _setting(
        "auto",
        "weights' and activations' type; auto: bfloat16 on CUDA, float32 on the CPU",
        flag=Flag(metavar="auto|bfloat16|float16|float32"),
    )
    max_num_seqs: int = _setting(
        256,
        "requests decoded together in one engine step at most",
        flag=Flag(type=positive_int, metavar="N"),
    )
    max_num_batched_tokens: int | None = _setting(
        None,
        "tokens per engine step: with max_num_seqs, throughput against latency (`kvbatch bench "
        "rag --sweep` measures the grid)",
        shown=f"{CUDA_BATCHED_TOKENS} on CUDA, {CPU_BATCHED_TOKENS} on the CPU",
        flag=Flag(type=positive_int, metavar="N"),
    )
    max_model_len: int | None = _setting(
        None,
        "longest prompt + answer in tokens; a longer request fails alone",
        shown="the model's context length (a job's: its longest request), capped at what "
        "the KV cache holds",
        flag=Flag(type=positive_int, metavar="N"),
    )
    longest_request: int | None = _setting(
        None,
        "the longest prompt + answer the caller will send (a job's, known before the model "
        "loads): with max_model_len unset, the context is this, capped at the model's and at "
        "what the KV cache holds",
        shown="the model's context",
    )
    block_size: int = _setting(
        16,
        "tokens per KV-cache block, a power of two; prefixes are shared in whole blocks",
        flag=Flag(type=power_of_two, metavar="N"),
    )
    enable_prefix_caching: bool = _setting(
        True,
        "reuse the KV of prompt prefixes that earlier requests computed",
        flag=Flag(
            name="--no-prefix-caching",
            negates=True,
            help="do not reuse the KV of prompt prefixes that earlier requests computed",
        ),
    )
    sliding_window_kv: bool = _setting(
        True,
        "sliding-window layers (Gemma 2/3's local layers) keep their own block tables and free "
        "the blocks that have left their window",
        flag=Flag(
            name="--no-sliding-window-kv",
            negates=True,
            help="sliding-window layers keep every block of a sequence, as full-attention "
            "layers do (fewer sequences fit in the KV cache)",
        ),
    )
    attention_backend: str = _setting(
        "auto",
        "attention kernels: triton (GPU), torch (the reference, CPU and GPU) or auto (triton "
        "on CUDA, torch on the CPU)",
        flag=Flag(metavar="auto|torch|triton"),
    )
    speculative: str | SpecConfig | None = _setting(
        None,
        "speculative decoding: ngram (prompt lookup) or draft:PATH (a draft model with the "
        "target's vocabulary); LLM also takes a SpecConfig",
        shown="off",
        flag=Flag(metavar="ngram|draft:PATH"),
    )
    num_speculative_tokens: int | None = _setting(
        None,
        "tokens proposed per step with speculative decoding",
        shown=str(SpecConfig.num_speculative_tokens),
        flag=Flag(type=positive_int, metavar="K"),
    )
    quantization: str | None = _setting(
        None,
        "quantize a float checkpoint at load: fp8 (FP8 weights with per-channel scales, "
        "activations per token; embeddings and lm_head kept). Quantized checkpoints "
        "(compressed-tensors, fp8, GPTQ, AWQ) are detected from their config.json without it",
        shown="the checkpoint's own",
        flag=Flag(choices=QUANTIZATION_CHOICES),
    )
    kv_cache_bytes: int | None = _setting(
        None,
        "the KV pool's size, e.g. 4GiB: the CPU's budget; on CUDA it replaces "
        "kv_cache_memory_fraction",
        shown=f"{DEFAULT_CPU_KV_BYTES >> 30}GiB on the CPU, the fraction on CUDA",
        flag=Flag(group="memory", type=byte_size, metavar="SIZE"),
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "auto: K/V in the model's dtype; fp8: E4M3 with per-layer scales (the checkpoint's "
        "kv_cache_scheme, else 1.0), twice bfloat16's tokens in the same memory",
        flag=Flag(group="gpu", choices=KV_CACHE_DTYPE_NAMES),
    )
    kv_cache_memory_fraction: float = _setting(
        0.90,
        "CUDA: share of the memory left after the weights and the largest step's activations "
        "that the KV pool takes (unlike vLLM's gpu_memory_utilization, not a share of the "
        "whole GPU)",
        flag=Flag(group="gpu", type=fraction, metavar="F"),
    )
    long_prefill_token_threshold: int = _setting(
        2048,
        "while others decode, a prompt's chunk costs at most this many tokens' worth of "
        "compute (0 = no cap)",
        flag=Flag(group="gpu", type=non_negative_int, metavar="N"),
    )
    long_prefill_step_ratio: float | None = _setting(
        None,
        "while others decode, a step with a longer prompt's chunk takes at most this many plain "
        "decode steps' time, the engine timing its steps (0 = off)",
        shown=f"{CUDA_LONG_PREFILL_STEP_RATIO} on CUDA, off on the CPU",
        flag=Flag(group="gpu", type=step_ratio, metavar="R"),
    )
    cuda_graph_max_chunk: int = _setting(
        512,
        "decode steps with one prompt chunk of up to this many tokens replay CUDA graphs "
        "(0 = decode steps only)",
        flag=Flag(group="gpu", type=non_negative_int, metavar="N"),
    )
    cuda_graphs: bool = _setting(
        True,
        "CUDA: decode steps replay captured CUDA graphs",
        flag=Flag(
            group="gpu",
            name="--enforce-eager",
            negates=True,
            help="CUDA: run every step eagerly, capturing no CUDA graphs (less memory and a "
            "quicker start; slower decoding)",
        ),
    )
    async_scheduling: bool | None = _setting(
        None,
        "schedule the next step while the GPU runs this one",
        shown="on CUDA, unless speculative",
        flag=Flag(group="memory", both=True),
    )
    cascade_attention: bool = _setting(
        True,
        "shared-prefix (cascade) attention: decodes sharing prefix blocks read them once per group",
        flag=Flag(
            group="memory",
            name="--no-cascade-attention",
            negates=True,
            help="shared-prefix (cascade) attention off: each running request reads a prefix "
            "it shares with others on its own",
        ),
    )
    num_kv_blocks: int | None = _setting(
        None,
        "the KV pool's exact size in blocks, over both budgets",
        shown="from the budget",
    )
    freeze_gc: bool | None = _setting(
        None,
        "freeze the heap the engine starts with, out of the cycle collector's full passes",
        shown="on CUDA",
    )
    seed: int = _setting(0, "the sampler's seed for requests that give none")

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, Any], caller: str = "LLM") -> EngineArgs:
        """The settings of `caller`'s keywords; a name that is not a setting is a TypeError
        that offers the closest ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in keywords if k not in names]
        if unknown:
            hints = [
                f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k)
                for k in unknown
                for close in [difflib.get_close_matches(k, names, n=1)]
            ]
            raise TypeError(f"{caller}() got unexpected keyword arguments: {', '.join(hints)}")
        return cls(**keywords)


class EngineKwargs(TypedDict, total=False):
    """`LLM`'s keywords after the model, for editors and type checkers: EngineArgs' fields and
    types (tests/engine/core/test_args.py keeps the two equal)."""

    revision: str | None
    reasoning_parser: str | None
    device: str
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int | None
    max_model_len: int | None
    longest_request: int | None
    block_size: int
    enable_prefix_caching: bool
    sliding_window_kv: bool
    attention_backend: str
    speculative: str | SpecConfig | None
    num_speculative_tokens: int | None
    quantization: str | None
    kv_cache_bytes: int | None
    kv_cache_dtype: str
    kv_cache_memory_fraction: float
    long_prefill_token_threshold: int
    long_prefill_step_ratio: float | None
    cuda_graph_max_chunk: int
    cuda_graphs: bool
    async_scheduling: bool | None
    cascade_attention: bool
    num_kv_blocks: int | None
    freeze_gc: bool | None
    seed: int


DEFAULTS = EngineArgs()


def setting_help(f: dataclasses.Field) -> str:
    return f.metadata["help"]


def setting_flag(f: dataclasses.Field) -> Flag | None:
    return f.metadata["flag"]


def default_in_words(f: dataclasses.Field) -> str:
    """The default as help shows it: the words for a device-dependent or None default."""
    return f.metadata["shown"] or str(f.default)


def settings_table() -> str:
    """docs/ENGINE.md's table of the settings (a test checks the page holds this text)."""
    rows = [
        "| `LLM` keyword | flag | default | what it sets |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(EngineArgs):
        flag = setting_flag(f)
        default = f"`{f.default!r}`".replace("'", '"')
        if f.metadata["shown"]:
            default += f" ({f.metadata['shown']})"
        cells = [f"`{f.name}`", _flag_cell(f.name, flag), default, setting_help(f)]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _flag_cell(name: str, flag: Flag | None) -> str:
    if flag is None:
        return "(Python only)"
    option = flag.option(name)
    if flag.both:
        return f"`--[no-]{option[2:]}`"
    value = flag.metavar or ("{" + ",".join(flag.choices) + "}" if flag.choices else "")
    return f"`{option} {value}`" if value and not flag.negates else f"`{option}`"

"""One engine under test: the `Peer` contract, the options every engine runs with, and the
result of one timed run.

The harness drives every peer the same way, one after the other in one process:

    peer = make_peer(name, model_path, options)      # kvbatch.bench.peers
    peer.load()          # not timed
    peer.warmup()        # not timed: a tiny job, so lazy initialisation is not measured
    result = peer.run(prompts, max_tokens)   # timed: generate() alone
    peer.close()         # frees the model before the next engine loads

This module sits below every engine (kvbatch_peers.py, hf_peers.py) and the registry
(peers.py), so each of them imports it and none imports another.
"""

from __future__ import annotations

import gc
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from kvbatch.engine.core.args import DEFAULTS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

WARMUP_PROMPT_LEN = 8
"""Shorter than one KV block: the tiny warm-up leaves nothing in kvbatch's prefix cache."""


@dataclass(frozen=True)
class EngineOptions:
    """What every engine runs with; the kvbatch fields pass straight through to `engine.LLM`."""

    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_num_batched_tokens: int | None = None  # None: the engine's default
    block_size: int = DEFAULTS.block_size
    enable_prefix_caching: bool = DEFAULTS.enable_prefix_caching
    kv_cache_memory_fraction: float | None = None  # CUDA KV pool share; None = the engine's
    kv_cache_dtype: str | None = None  # kvbatch: "auto" or "fp8"; None = the engine's default
    quantization: str | None = None  # kvbatch: "fp8" (online); None = the checkpoint's own
    attention_backend: str = DEFAULTS.attention_backend  # kvbatch: auto = triton on CUDA
    long_prefill_token_threshold: int | None = None  # kvbatch: None = the engine's default
    long_prefill_step_ratio: float | None = None  # kvbatch: None = the engine's default
    cuda_graph_max_chunk: int | None = None  # kvbatch: None = the engine's default
    cuda_graphs: bool | None = None  # kvbatch: None = the engine's default (on; used on CUDA)
    async_scheduling: bool | None = None  # kvbatch: None = the engine's default (on for CUDA)
    freeze_gc: bool | None = None  # kvbatch: None = the engine's default (on for CUDA)
    hf_batch_size: int | None = None  # hf-static: requests per static batch; None = all

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.hf_batch_size is not None and self.hf_batch_size < 1:
            raise ValueError(f"hf_batch_size must be >= 1, got {self.hf_batch_size}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class PeerUnavailable(RuntimeError):
    """This engine cannot run here (e.g. the installed transformers lacks the API it needs)."""


@dataclass
class Timings:
    """Per request, in input order: seconds from the run's start to its first token, and the
    mean seconds between its later tokens (None where the engine cannot tell)."""

    ttft: list[float | None]
    tpot: list[float | None]


@dataclass
class RunResult:
    """One timed run of one engine over a whole workload."""

    engine: str
    seconds: float
    output_tokens: int
    num_requests: int
    token_ids: list[list[int]] = field(repr=False)  # per request, in input order
    extra: dict[str, Any] = field(default_factory=dict)
    timings: Timings | None = field(default=None, repr=False)
    long_prefill: dict[str, Any] | None = None  # long-prefill only: the gap figures

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")


class Peer(ABC):
    """One engine under test. Subclasses set `name` and implement `load` and `generate`.

    Contract: `load` must be called before `warmup`/`run`; `generate` returns, for each prompt
    in input order, exactly the token ids the engine decoded (greedy, `max_tokens` of them,
    EOS ignored); `run` times `generate` alone; `close` drops every reference to the model.
    """

    name: ClassVar[str]
    supports_long_prefill: ClassVar[bool] = False
    # one-off costs on the first run of a workload's shape (kvbatch: Triton compiles and graph
    # captures; hf-cb: generate_batch's manager): see harness.warm_up
    needs_full_warmup: ClassVar[bool] = False

    def __init__(self, model_path: str | Path, options: EngineOptions) -> None:
        self.model_path = str(model_path)
        self.options = options
        self.timings: Timings | None = None  # set by `generate` where the engine can

    @abstractmethod
    def load(self) -> None:
        """Load weights and build the engine (not timed)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy-decode exactly `max_tokens` tokens for every prompt."""

    def run_extra(self, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, Any]:
        """Engine-specific figures about the last `generate` (e.g. prefix-cache hits)."""
        return {}

    def before_run(self) -> None:
        """Called just before the timed `generate` (not timed): e.g. to snapshot counters."""
        return None

    def after_warmup(self) -> None:
        """After the full warm-up run (not timed): one-off work that run revealed."""
        return None

    def warmup(self) -> None:
        """A tiny untimed job so that one-off costs (threads, allocator, lazy init) are paid."""
        self.generate([[5 + i] * WARMUP_PROMPT_LEN for i in range(2)], max_tokens=2)

    def run(self, prompts: list[list[int]], max_tokens: int) -> RunResult:
        """Time `generate` over `prompts` and count the tokens it produced."""
        self.before_run()
        self.timings = None
        self._synchronize()
        start = time.perf_counter()
        outputs = self.generate(prompts, max_tokens)
        self._synchronize()
        seconds = time.perf_counter() - start
        return RunResult(
            engine=self.name,
            seconds=seconds,
            output_tokens=sum(len(o) for o in outputs),
            num_requests=len(prompts),
            token_ids=outputs,
            extra=self.run_extra(prompts, outputs),
            timings=self.timings,
        )

    def run_long_prefill(
        self, prompts: list[list[int]], long_prompt: list[int], workload: Any
    ) -> RunResult:
        """The long-prefill job: `prompts` decode, and `long_prompt` arrives mid-run."""
        raise PeerUnavailable(f"{self.name} cannot add a prompt mid-run: long-prefill is kvbatch's")

    def close(self) -> None:
        """Free the model so the next engine loads into clean memory."""
        for attr in list(vars(self)):
            if attr not in ("model_path", "options", "name", "timings"):
                setattr(self, attr, None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _synchronize(self) -> None:
        if self.options.device.startswith("cuda"):
            torch.cuda.synchronize()

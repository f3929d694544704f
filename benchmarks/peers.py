"""The engines a benchmark compares: kvbatch itself and its peers, behind one small contract.

Each engine is a `Peer` subclass registered by name. The harness drives every peer the same
way, one after the other in one process:

    peer = make_peer(name, model_path, options)
    peer.load()          # not timed
    peer.warmup()        # not timed: a tiny job, so lazy initialisation is not measured
    result = peer.run(prompts, max_tokens)   # timed: generate() alone
    peer.close()         # frees the model before the next engine loads

Adding an engine is one subclass that implements `load` and `generate`, decorated with
`@register_peer`, in a module imported at the end of this one (the transformers peers are in
hf_peers.py). A peer that can time its tokens fills `self.timings` in `generate` (time to
first token and time per output token per request); the table shows '-' where it does not.
Only kvbatch runs `long-prefill` (a prompt arriving mid-run needs a streaming engine).
"""

from __future__ import annotations

import gc
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

WARMUP_PROMPT_LEN = 8
"""Shorter than one KV block: the tiny warm-up leaves nothing in kvbatch's prefix cache."""


@dataclass(frozen=True)
class EngineOptions:
    """What every engine runs with; the kvbatch fields pass straight through to `engine.LLM`."""

    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the engine's default
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_fraction: float | None = None  # CUDA KV pool share; None = the engine's
    kv_cache_dtype: str | None = None  # kvbatch: "auto" or "fp8"; None = the engine's default
    attention_backend: str = "auto"  # kvbatch: "auto" is triton on CUDA, torch on the CPU
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


# EngineOptions fields passed to kvbatch's engine only when set (None: the engine's default)
ENGINE_DEFAULTED = (
    "kv_cache_memory_fraction",
    "kv_cache_dtype",
    "long_prefill_token_threshold",
    "long_prefill_step_ratio",
    "cuda_graph_max_chunk",
    "cuda_graphs",
    "freeze_gc",
)


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


PEERS: dict[str, type[Peer]] = {}
"""Registry by name: the names `kvbatch bench --peers` accepts."""


def register_peer(cls: type[Peer]) -> type[Peer]:
    """Class decorator: make `cls` available under `cls.name`."""
    if cls.name in PEERS:
        raise ValueError(f"peer {cls.name!r} is already registered")
    PEERS[cls.name] = cls
    return cls


def make_peer(name: str, model_path: str | Path, options: EngineOptions) -> Peer:
    """A new, unloaded engine of the registered kind `name`."""
    try:
        cls = PEERS[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(PEERS))}") from None
    return cls(model_path, options)


@register_peer
class KvbatchPeer(Peer):
    """kvbatch's own engine through its public API (`engine.LLM`)."""

    name = "kvbatch"
    supports_long_prefill = True
    needs_full_warmup = True  # Triton compiles and CUDA graph captures, on CUDA

    @property
    def async_scheduling(self) -> bool | None:
        return self.options.async_scheduling

    def load(self) -> None:
        from kvbatch.engine import (  # the kvbatch.engine is imported only when benchmarked
            LLM,
            SamplingParams,
        )

        o = self.options
        self._sampling_params = SamplingParams
        # the options left at None keep the engine's defaults
        kwargs: dict[str, Any] = {
            k: getattr(o, k) for k in ENGINE_DEFAULTED if getattr(o, k) is not None
        }
        if self.async_scheduling is not None:
            kwargs["async_scheduling"] = self.async_scheduling
        self.llm = LLM(
            model=self.model_path,
            device=o.device,
            dtype=o.dtype,
            max_num_seqs=o.max_num_seqs,
            max_num_batched_tokens=o.max_num_batched_tokens,
            block_size=o.block_size,
            enable_prefix_caching=o.enable_prefix_caching,
            attention_backend=o.attention_backend,
            **kwargs,
        )
        self._cached_tokens: list[int] = []
        self._stats_before: dict[str, Any] = {}
        from kvbatch.bench.step_profile import StepProfile

        self._profile = StepProfile(self.llm.engine)
        self.graphs_captured_after_warmup = 0  # see after_warmup
        self.graph_launches_after_warmup: dict[str, Any] | None = None  # see after_warmup

    def _params(self, max_tokens: int):
        return self._sampling_params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = self.llm.generate(prompts, self._params(max_tokens), use_tqdm=False)
        self._cached_tokens = [int(o.num_cached_tokens or 0) for o in outs]
        self.timings = _timings_from_metrics(outs)
        return [list(o.outputs[0].token_ids) for o in outs]

    def run_long_prefill(
        self, prompts: list[list[int]], long_prompt: list[int], workload: Any
    ) -> RunResult:
        """The decoders start; the long prompt joins once each has `long_prompt_after` tokens
        (benchmarks/long_prefill.py drives the steps and measures the gaps)."""
        from kvbatch.bench.long_prefill import drive_long_prefill

        self.before_run()
        self._synchronize()
        run = drive_long_prefill(
            self.llm.engine,
            prompts,
            long_prompt,
            workload,
            self._params,
            synchronize=self._synchronize,
            step_detail=lambda: self._profile.last,
        )
        self._cached_tokens = [int(o.num_cached_tokens or 0) for o in run.outputs]
        outputs = [list(o.outputs[0].token_ids) for o in run.outputs]
        return RunResult(
            engine=self.name,
            seconds=run.seconds,
            output_tokens=sum(len(o) for o in outputs),
            num_requests=len(prompts),
            token_ids=outputs,
            extra=self.run_extra(prompts, outputs),
            timings=_timings_from_metrics(run.outputs),
            long_prefill=run.figures,
        )

    def after_warmup(self) -> None:
        """The mixed-step graphs the timed runs' chunks may pick and the warm-up did not:
        captured now, so no timed step waits for a capture (engine/cuda_graphs.py), and launched
        once, so none waits for a graph's upload; what those launches cost, first and again."""
        self.graphs_captured_after_warmup = self.llm.engine.capture_chunk_graphs()
        graphs = self.llm.engine.runner.step_graphs
        launches = graphs.first_launches if self.graphs_captured_after_warmup else None
        self.graph_launches_after_warmup = launches._asdict() if launches else None

    def before_run(self) -> None:
        self._stats_before = _plain(self.llm.stats())
        self._profile.clear()

    def run_extra(self, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prompts)
        cached = sum(self._cached_tokens)
        stats = self.llm.stats()
        after = _plain(stats)
        return {
            "prompt_tokens": prompt_tokens,
            "cached_prompt_tokens": cached,
            # prompt tokens whose KV came from the cache, from the request outputs
            "cached_token_fraction": cached / prompt_tokens if prompt_tokens else 0.0,
            # the engine's counters over this run alone (warm-up and earlier repeats excluded)
            "prefix_hit_rate": _hit_rate_delta(self._stats_before, after),
            # the engine's own figure, over the LLM's whole life
            "prefix_hit_rate_total": _float_or_none(getattr(stats, "prefix_hit_rate", None)),
            "stats": after,
            "step_profile": self._profile.summary(),  # benchmarks/step_profile.py
            "graphs_captured_after_warmup": self.graphs_captured_after_warmup,
            "graph_launches_after_warmup": self.graph_launches_after_warmup,
        }


@register_peer
class KvbatchInTurnPeer(KvbatchPeer):
    """kvbatch with async scheduling off: each step starts after the previous step's tokens
    are on the host. Its ratio is what async scheduling gains."""

    name = "kvbatch-sync"

    @property
    def async_scheduling(self) -> bool | None:
        return False


def _timings_from_metrics(outs: list[Any]) -> Timings | None:
    """kvbatch's per-request times, from RequestOutput.metrics (None if the engine has none)."""
    metrics = [getattr(o, "metrics", None) for o in outs]
    if all(m is None for m in metrics):
        return None
    return Timings(
        ttft=[None if m is None else m.time_to_first_token for m in metrics],
        tpot=[None if m is None else m.time_per_output_token for m in metrics],
    )


def _plain(obj: Any) -> dict[str, Any]:
    """A stats object as a JSON-friendly dict (numbers, strings, bools and None only)."""
    if hasattr(obj, "_asdict"):
        items = obj._asdict()
    elif isinstance(obj, dict):
        items = obj
    elif hasattr(obj, "__dataclass_fields__"):
        items = {f: getattr(obj, f) for f in obj.__dataclass_fields__}
    else:
        try:
            items = {k: v for k, v in vars(obj).items() if not k.startswith("_")}
        except TypeError:  # no __dict__ (slots, None)
            items = {}
    return {k: v for k, v in items.items() if v is None or isinstance(v, (bool, int, float, str))}


def _hit_rate_delta(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """prefix_hits / prefix_queries between two stats snapshots; None if the engine has no
    such counters or made no query."""
    keys = ("prefix_hits", "prefix_queries")
    if not all(isinstance(d.get(k), int) for d in (before, after) for k in keys):
        return None
    queries = after["prefix_queries"] - before["prefix_queries"]
    hits = after["prefix_hits"] - before["prefix_hits"]
    return hits / queries if queries > 0 else None


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)


# The transformers peers register themselves on import; last, as they subclass Peer.
from kvbatch.bench import hf_peers  # noqa: E402, F401

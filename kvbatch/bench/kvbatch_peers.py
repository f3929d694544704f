"""kvbatch's own engine as a benchmark peer, through its public API (`kvbatch.engine.LLM`),
with async scheduling on (the engine's default) and off (`kvbatch-sync`)."""

from __future__ import annotations

from typing import Any

from kvbatch.bench.long_prefill import drive_long_prefill
from kvbatch.bench.peer import Peer, RunResult, Timings
from kvbatch.bench.step_profile import StepProfile

# EngineOptions fields passed to kvbatch's engine only when set (None: the engine's default)
ENGINE_DEFAULTED = (
    "kv_cache_memory_fraction",
    "kv_cache_dtype",
    "quantization",
    "long_prefill_token_threshold",
    "long_prefill_step_ratio",
    "cuda_graph_max_chunk",
    "cuda_graphs",
    "freeze_gc",
)


class KvbatchPeer(Peer):
    """kvbatch's own engine through its public API (`engine.LLM`)."""

    name = "kvbatch"
    supports_long_prefill = True
    needs_full_warmup = True  # Triton compiles and CUDA graph captures, on CUDA

    @property
    def async_scheduling(self) -> bool | None:
        return self.options.async_scheduling

    def load(self) -> None:
        # imported when a run loads the engine, not when the bench CLI parses its options
        from kvbatch.engine import LLM, SamplingParams

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
        (bench/long_prefill.py drives the steps and measures the gaps)."""
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
        captured now, so no timed step waits for a capture (engine/exec/cuda_graphs.py), and
        launched once, so none waits for a graph's upload; what those launches cost, first and
        again."""
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
            "step_profile": self._profile.summary(),  # bench/step_profile.py
            "graphs_captured_after_warmup": self.graphs_captured_after_warmup,
            "graph_launches_after_warmup": self.graph_launches_after_warmup,
        }


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

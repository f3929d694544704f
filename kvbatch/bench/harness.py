"""Side-by-side benchmark: kvbatch and its peers on the same prompts, in one process.

Machines are noisy, so figures are only compared within one run: every engine runs here one
after the other, with the same prompts and the same torch thread count, and the table quotes
each engine's time as a ratio to kvbatch's. Per engine:

    load (not timed) -> warm-up (not timed) -> `repeat` timed runs -> free the model

Repeat r uses the workload drawn with seed `seed + r` (the same for every engine), so a prefix
cache warmed by one repeat cannot serve the next. Seconds are the median over the repeats.

Latency per engine: time to first token (TTFT, from the run's start, when every request
arrives) and time per output token (TPOT, the mean gap after the first token), p50 and p99
over all requests of all repeats; '-' where the engine cannot tell. The floor fraction is the
workload's hardware floor (docs/BENCHMARKS.md) / seconds, shown only on the device the
floor was worked out for.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbatch.bench.kernel_profile import format_kernel_profile, profile_engine_run
from kvbatch.bench.long_prefill import reference_and_prefill_text
from kvbatch.bench.machine import machine_info
from kvbatch.bench.peers import (
    PEERS,
    EngineOptions,
    Peer,
    PeerUnavailable,
    RunResult,
    make_peer,
)
from kvbatch.bench.step_profile import format_step_profile
from kvbatch.bench.text_table import format_rows
from kvbatch.bench.workloads import (
    RANDOM_MODELS,
    SMOLLM2,
    Workload,
    make_long_prompt,
    make_prompts,
)

KVBATCH = "kvbatch"


class BenchError(RuntimeError):
    """The benchmark cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run needs. `engines` run in this order; the first is the
    reference that ratios and greedy matches are taken against (kvbatch when it runs)."""

    workload: Workload
    model_path: str
    engines: tuple[str, ...] = (KVBATCH,)
    options: EngineOptions = field(default_factory=EngineOptions)
    repeat: int = 1
    threads: int | None = None  # torch threads for every engine; None = torch's default
    compare_requests: int = 4  # greedy tokens compared on this many leading requests
    kernel_profile: bool = False  # one more kvbatch run under torch.profiler (kernel_profile.py)
    full_warmup: bool | None = None  # an untimed run of the whole workload; None: see warm_up
    command: str = ""

    def __post_init__(self) -> None:
        if not self.engines:
            raise BenchError("no engine to run: add --peers, or drop --skip-kvbatch")
        if len(set(self.engines)) != len(self.engines):
            raise BenchError(f"engines listed twice: {', '.join(self.engines)}")
        if self.repeat < 1:
            raise BenchError(f"--repeat must be >= 1, got {self.repeat}")
        if self.threads is not None and self.threads < 1:
            raise BenchError(f"--threads must be >= 1, got {self.threads}")
        if self.compare_requests < 0:
            raise BenchError(f"--compare must be >= 0, got {self.compare_requests}")


@dataclass
class EngineSummary:
    """One engine's figures over all repeats."""

    engine: str
    seconds: float  # median over repeats
    seconds_all: list[float]
    output_tokens: int  # per repeat
    tokens_per_s: float
    ratio: float | None  # this engine's seconds / the reference's: how much faster kvbatch is
    extra: dict[str, Any]  # engine-specific figures of the last repeat
    ttft_p50: float | None = None  # seconds; None where the engine cannot tell
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    floor_fraction: float | None = None  # floor seconds / seconds, on the floor's device only
    long_prefill: dict[str, Any] | None = None  # long-prefill gap figures (median over repeats)


@dataclass
class GreedyMatch:
    """How many of the first `compared` requests decoded the same tokens as the reference."""

    engine: str
    reference: str
    matching: int
    compared: int


@dataclass
class BenchReport:
    config: BenchConfig
    engines: list[EngineSummary]
    greedy_match: list[GreedyMatch]
    machine: dict[str, Any]
    date: str
    warnings: list[str]

    @property
    def reference(self) -> str:
        """The engine ratios are taken against: the first that ran (kvbatch when it ran)."""
        return self.engines[0].engine if self.engines else self.config.engines[0]

    def summary(self, engine: str) -> EngineSummary | None:
        return next((s for s in self.engines if s.engine == engine), None)

    @property
    def prefix_hit_rate(self) -> float | None:
        """kvbatch's own prefix-cache hit rate (None when kvbatch did not run)."""
        s = self.summary(KVBATCH)
        return None if s is None else s.extra.get("prefix_hit_rate")

    @property
    def cached_token_fraction(self) -> float | None:
        """Share of the last kvbatch run's prompt tokens whose KV came from the prefix cache."""
        s = self.summary(KVBATCH)
        return None if s is None else s.extra.get("cached_token_fraction")

    @property
    def floor_applies(self) -> bool:
        return floor_applies(self.config.workload, self.machine)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what `--json` writes)."""
        c = self.config
        return {
            "kind": "bench",
            "workload": c.workload.to_dict(),
            "model_path": c.model_path,
            "options": dataclasses.asdict(c.options),
            "repeat": c.repeat,
            "reference": self.reference,
            "engines": [dataclasses.asdict(s) for s in self.engines],
            "prefix_hit_rate": self.prefix_hit_rate,
            "cached_token_fraction": self.cached_token_fraction,
            "greedy_match": [dataclasses.asdict(m) for m in self.greedy_match],
            "floor": {
                "seconds": c.workload.floor_seconds,
                "device": c.workload.floor_device,
                "applies": self.floor_applies,
            },
            "warnings": list(self.warnings),
            "machine": self.machine,
            "date": self.date,
            "command": c.command,
        }

    def format_table(self) -> str:
        """The report as the plain-text table `kvbatch bench` prints."""
        c = self.config
        m = self.machine
        median = "median of " if c.repeat > 1 else ""
        runs = f"{median}{c.repeat} run{'s' if c.repeat > 1 else ''}"
        where = f"{m['device']} ({m['device_name']}), {m['torch_threads']} torch threads"
        lines = [c.workload.summary(), f"{where}, {runs}, {self.date}", ""]
        matches = {g.engine: g for g in self.greedy_match}
        show_floor = self.floor_applies
        head = ["engine", "seconds", "output tok/s"] + LATENCY_HEADERS + ["ratio"]
        head += ["of floor"] if show_floor else []
        rows = [tuple(head + ["greedy match"])]
        for s in self.engines:
            g = matches.get(s.engine)
            match = "reference" if s.engine == self.reference else "-"
            if g is not None:
                match = f"{g.matching}/{g.compared}"
            ratio = "-" if s.ratio is None else f"{s.ratio:.2f}"
            row = [s.engine, f"{s.seconds:.2f}", f"{s.tokens_per_s:.1f}"]
            row += latency_cells(s) + [ratio]
            row += [_pct(s.floor_fraction)] if show_floor else []
            rows.append(tuple(row + [match]))
        lines += format_rows(rows)
        lines.append("")
        lines.append(
            "TTFT / TPOT in ms (p50, p99 over requests): time to first token from the "
            "run's start, mean time per output token after it"
        )
        if show_floor:
            w = c.workload
            lines.append(
                f"of floor = {w.floor_seconds:g} s (the {w.floor_device} floor of {w.name}, "
                "docs/BENCHMARKS.md) / seconds"
            )
        for s in self.engines:
            if s.long_prefill is not None:
                lines.append(format_long_prefill(s.engine, s.long_prefill))
        kv = self.summary(KVBATCH)
        if kv is not None:
            rate = self.prefix_hit_rate
            x = kv.extra
            lines.append(
                f"kvbatch prefix cache: hit rate {_fmt(rate)} (engine counters, last run); "
                f"{x.get('cached_prompt_tokens')} of {x.get('prompt_tokens')} prompt tokens "
                f"cached ({_fmt(self.cached_token_fraction)}) in the last run"
            )
            if x.get("stats"):
                lines.append(format_weights_and_kv(x["stats"]))
            if x.get("step_profile", {}).get("steps"):
                lines.append(format_step_profile(x["step_profile"]))
            if x.get("kernel_profile"):
                lines.append(format_kernel_profile(x["kernel_profile"]))
        lines.append(
            f"ratio = median over rounds of engine seconds / {self.reference} seconds "
            f"(how many times faster {self.reference} is)"
        )
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def format_weights_and_kv(stats: dict[str, Any]) -> str:
    """One line from kvbatch's LLM.stats(): the weights' size and format, and the KV pool's
    element dtype and capacity in tokens (what quantizing the weights or the cache changes)."""
    size = stats.get("weight_bytes", 0) / (1 << 30)
    size_text = f"{size:.2f} GiB" if size >= 0.1 else f"{size * 1024:.2f} MiB"
    fmt = stats.get("quantization") or "float"
    blocks, block_size = stats.get("num_kv_blocks", 0), stats.get("block_size", 0)
    return (
        f"kvbatch memory: weights {size_text} ({fmt}); KV cache {stats.get('kv_cache_dtype')}, "
        f"{blocks} blocks x {block_size} = {blocks * block_size} tokens"
    )


LATENCY_HEADERS = ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]


def latency_cells(s: Any) -> list[str]:
    """The four latency figures of a summary (anything with ttft_p50 ... tpot_p99), in ms."""
    return [_ms(getattr(s, k)) for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")]


LONG_PREFILL_TARGET = 3.0
"""While the long prompt is prefilled, no decoder waits more than 3 decode steps."""


def format_long_prefill(engine: str, f: dict[str, Any]) -> str:
    """One line of long-prefill figures: the longest gap against a plain decode step."""
    ratio = f.get("gap_ratio")
    verdict = ""
    if ratio is not None:
        verdict = " (meets" if ratio <= LONG_PREFILL_TARGET else " (misses"
        verdict += f" the target of <= {LONG_PREFILL_TARGET:g})"
    reference, prefill = reference_and_prefill_text(f)
    return (
        f"{engine} long-prefill: longest token gap {_ms(f.get('max_token_gap_s'))} ms, "
        f"{reference} {_ms(f.get('median_decode_step_s'))} ms, ratio "
        f"{'-' if ratio is None else f'{ratio:.1f}'}{verdict}{prefill}; the "
        f"{f.get('long_prompt_tokens')}-token prompt's first token after "
        f"{_ms(f.get('long_prompt_ttft_s'))} ms"
    )


def floor_applies(workload: Workload, machine: dict[str, Any]) -> bool:
    """Whether the workload has a floor for the device the run used."""
    if workload.floor_seconds is None:
        return False
    name = str(machine.get("device_name", ""))
    return str(machine.get("device", "")).startswith("cuda") and workload.floor_device in name


def percentiles(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """p50 and p99 of the known values (None when there are none)."""
    known = [float(v) for v in values if v is not None]
    if not known:
        return None, None
    import numpy as np

    return float(np.percentile(known, 50)), float(np.percentile(known, 99))


def latency_summary(runs: Sequence[RunResult]) -> dict[str, float | None]:
    """TTFT and TPOT p50/p99 over every request of every run."""
    ttft: list[float | None] = []
    tpot: list[float | None] = []
    for r in runs:
        if r.timings is not None:
            ttft += r.timings.ttft
            tpot += r.timings.tpot
    t50, t99 = percentiles(ttft)
    p50, p99 = percentiles(tpot)
    return {"ttft_p50": t50, "ttft_p99": t99, "tpot_p50": p50, "tpot_p99": p99}


def long_prefill_summary(runs: Sequence[RunResult]) -> dict[str, Any] | None:
    """The long-prefill figures of the run whose gap ratio is the median (None if none)."""
    figures = [r.long_prefill for r in runs if r.long_prefill is not None]
    if not figures:
        return None
    figures.sort(key=lambda f: (f.get("gap_ratio") is None, f.get("gap_ratio") or 0.0))
    return dict(figures[(len(figures) - 1) // 2], repeats=len(figures))


def draw_prompts(workload: Workload, vocab_size: int, repeat: int) -> list[Draw]:
    """One draw of the workload's prompts per repeat (seed + r)."""
    draws = []
    for r in range(repeat):
        w = workload.with_seed(workload.seed + r)
        long_prompt = make_long_prompt(w, vocab_size) if w.has_long_prompt else None
        draws.append(Draw(make_prompts(w, vocab_size), long_prompt))
    return draws


def warm_up(peer: Peer, config: BenchConfig, vocab_size: int) -> None:
    """The peer's own tiny job; then, for an engine with one-off costs on a workload's first
    run (`Peer.needs_full_warmup`: kvbatch's Triton kernels and CUDA graphs; hf-cb's
    generate_batch manager, sized for the workload and kept), one untimed run of the whole
    workload on a draw of its own. Triton specialises a kernel on its arguments (an integer
    equal to 1 or divisible by 16, flags such as shared-prefix groups), and a tiny job does not
    reach every variant `rag` does: each one left would be compiled, at up to a second or
    two, inside the first timed run. The run also grows the allocator's pools to the
    workload's peak and captures the CUDA graphs of the steps with a prompt chunk that the
    workload needs (each is captured on first use, in a step that waits for it); after it,
    `Peer.after_warmup` for a workload with a long prompt (kvbatch: the chunk buckets the run
    did not meet, since timed chunks may pick others in the next run; other workloads cut
    their chunks by the token budget alone, the same in every draw).
    `config.full_warmup` forces it on or off (None: on CUDA only)."""
    peer.warmup()
    full = config.full_warmup
    if full is None:
        full = config.options.device.startswith("cuda")
    if full and peer.needs_full_warmup:
        run_once(peer, *fresh_draw(config.workload, vocab_size, WARMUP_SEED_OFFSET))
        if config.workload.has_long_prompt:  # timed chunks: the next run may pick other sizes
            peer.after_warmup()


WARMUP_SEED_OFFSET = 1_000_000
PROFILE_SEED_OFFSET = 2_000_000
"""The full warm-up's and the profiled run's draws: far from the timed draws' seeds (seed + r),
so they share no prompt, and therefore no prefix-cache block, with them or each other: a
run over a draw already cached would measure the prefix cache, not the engine."""


def fresh_draw(workload: Workload, vocab_size: int, seed_offset: int) -> tuple[Workload, Draw]:
    """The workload at seed + seed_offset and its one draw."""
    w = workload.with_seed(workload.seed + seed_offset)
    return w, draw_prompts(w, vocab_size, 1)[0]


@dataclass
class Draw:
    """One repeat's prompts (and long-prefill's long prompt)."""

    prompts: list[list[int]]
    long_prompt: list[int] | None = None


def run_once(peer: Peer, workload: Workload, draw: Draw) -> RunResult:
    """One timed run of `peer` on one draw of the workload."""
    if draw.long_prompt is not None:
        return peer.run_long_prefill(draw.prompts, draw.long_prompt, workload)
    return peer.run(draw.prompts, workload.output_len)


def check_engines_support(workload: Workload, engines: Sequence[str]) -> None:
    """long-prefill needs engines that accept a prompt mid-run: kvbatch alone, so far."""
    if not workload.has_long_prompt:
        return
    unable = [n for n in engines if n in PEERS and not PEERS[n].supports_long_prefill]
    if unable:
        raise BenchError(
            f"{workload.name} adds a prompt mid-run, which {', '.join(unable)} cannot do: "
            "run it with kvbatch alone (drop --peers)"
        )


PEER_KV_FRACTION = 0.6
"""kvbatch's KV pool share of free CUDA memory when other engines share the process (and no
--kv-cache-memory-fraction was given): at the engine's default of 0.9, transformers' static
batch of 64 rag prompts would find too little memory left for its activations."""


def leave_room_for_peers(config: BenchConfig) -> BenchConfig:
    """`config` with kvbatch's KV pool at PEER_KV_FRACTION when peers run beside it on CUDA."""
    o = config.options
    if (
        o.device.startswith("cuda")
        and o.kv_cache_memory_fraction is None
        and KVBATCH in config.engines
        and len(config.engines) > 1
    ):
        options = dataclasses.replace(o, kv_cache_memory_fraction=PEER_KV_FRACTION)
        return dataclasses.replace(config, options=options)
    return config


def resolve_model(
    workload: Workload, model: str | Path | None = None, weights: str = "float"
) -> str:
    """The model path to benchmark: `model` if given, else the workload's default weights
    (the random-weight models are built from their config on first use, then cached), in
    `weights`' format ("float", "w4a16" or "fp8-block": bench/models.py)."""
    if model is not None:
        if weights != "float":
            raise BenchError(f"--weights {weights} applies to the random models: drop --model")
        path = Path(model).expanduser()
        if not path.exists():
            raise BenchError(f"--model {model}: no such file or folder")
        return str(path)
    if workload.model == SMOLLM2:
        if weights != "float":
            raise BenchError(f"--weights {weights} applies to the random models, not {SMOLLM2}")
        from kvbatch.fetch import smollm2_dir

        return str(smollm2_dir())
    if workload.model in RANDOM_MODELS:
        from kvbatch.bench.models import random_model_dir

        # "float" leaves the spec's own format (gpt-oss's is MXFP4, as published)
        return str(
            random_model_dir(workload.model, weights=None if weights == "float" else weights)
        )
    raise BenchError(
        f"workload {workload.name!r} runs on {workload.model!r}, which has no fetcher yet: "
        "pass --model PATH"
    )


def model_vocab_size(model_path: str | Path) -> int:
    """The vocabulary size in the model's config (a Hugging Face folder or a GGUF file)."""
    from transformers import AutoConfig

    path = Path(model_path)
    if path.suffix == ".gguf":
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        config = AutoConfig.from_pretrained(str(path))
    config = getattr(config, "get_text_config", lambda: config)()
    return int(config.vocab_size)


def run_benchmark(
    config: BenchConfig,
    progress: Callable[[str], None] | None = None,
    checkpoint: Callable[[BenchReport], None] | None = None,
) -> BenchReport:
    """Run every engine of `config` on the workload, one after the other, and compare them.

    With `config.kernel_profile`, `checkpoint` gets the report of the timed runs before the
    profiled run starts (the CLI writes its JSON then), so a profiler that crashes or hangs
    the process on some driver cannot take the timings with it."""
    say = progress or (lambda _msg: None)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    config = leave_room_for_peers(config)
    w = config.workload
    check_engines_support(w, config.engines)
    vocab_size = model_vocab_size(config.model_path)
    draws = draw_prompts(w, vocab_size, config.repeat)
    warnings: list[str] = []

    # All engines are loaded first and the repeats interleave (a, b, a, b, ...): these
    # machines drift by 10-30% over minutes, and a ratio of adjacent runs cancels the drift.
    peers = {}
    results: dict[str, list[RunResult]] = {name: [] for name in config.engines}
    try:
        for name in config.engines:
            peer = make_peer(name, config.model_path, config.options)
            say(f"{name}: loading {config.model_path}")
            try:
                peer.load()
                say(f"{name}: warm-up")
                warm_up(peer, config, vocab_size)
            except ImportError as e:
                peer.close()
                raise BenchError(f"cannot import engine {name!r}: {e}") from e
            except PeerUnavailable as e:  # e.g. hf-cb on a transformers without generate_batch
                warnings.append(f"{name} is unavailable and was skipped: {e}")
                say(f"{name}: unavailable: {e}")
                peer.close()
                del results[name]
                continue
            peers[name] = peer
        if not peers:
            raise BenchError("no engine could run: " + "; ".join(warnings))
        for r, draw in enumerate(draws):
            for name, peer in peers.items():
                say(f"{name}: run {r + 1}/{config.repeat} ({w.num_requests} requests)")
                results[name].append(run_once(peer, w, draw))
                say(f"{name}: {results[name][-1].seconds:.2f} s")
        report = build_report(config, results, warnings)
        if config.kernel_profile and KVBATCH in peers:
            if checkpoint is not None:
                checkpoint(report)
            say(f"{KVBATCH}: one more run under torch.profiler")
            pw, draw = fresh_draw(w, vocab_size, PROFILE_SEED_OFFSET)
            profile = profile_kvbatch(peers[KVBATCH], pw, draw, results[KVBATCH], warnings)
            if profile is not None:
                report.summary(KVBATCH).extra["kernel_profile"] = profile
    finally:
        for peer in peers.values():
            peer.close()
    return report


def build_report(
    config: BenchConfig, results: dict[str, list[RunResult]], warnings: list[str]
) -> BenchReport:
    """The engines' timed runs summarised and compared with the first (the reference)."""
    w = config.workload
    reference = next(iter(results))
    machine = machine_info(config.options.device)
    floor = w.floor_seconds if floor_applies(w, machine) else None
    summaries = []
    for name, runs in results.items():
        seconds = statistics.median(r.seconds for r in runs)
        tokens = runs[-1].output_tokens
        for r in runs:
            if r.output_tokens != w.output_tokens:
                warnings.append(
                    f"{name} produced {r.output_tokens} output tokens, expected {w.output_tokens}"
                )
        summaries.append(
            EngineSummary(
                engine=name,
                seconds=seconds,
                seconds_all=[r.seconds for r in runs],
                output_tokens=tokens,
                tokens_per_s=tokens / seconds if seconds > 0 else float("inf"),
                ratio=_paired_ratio(runs, results[reference]),
                extra=dict(runs[-1].extra),
                floor_fraction=floor / seconds if floor is not None and seconds > 0 else None,
                long_prefill=long_prefill_summary(runs),
                **latency_summary(runs),
            )
        )

    k = min(config.compare_requests, w.num_requests)
    ref_tokens = results[reference][0].token_ids[:k]
    matches = [
        GreedyMatch(
            engine=name,
            reference=reference,
            matching=sum(a == b for a, b in zip(ref_tokens, runs[0].token_ids[:k])),
            compared=k,
        )
        for name, runs in results.items()
        if name != reference and k > 0
    ]
    return BenchReport(
        config=config,
        engines=summaries,
        greedy_match=matches,
        machine=machine,
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        warnings=warnings,
    )


def profile_kvbatch(
    peer: Peer, workload: Workload, draw: Draw, runs: list[RunResult], warnings: list[str]
) -> dict[str, Any] | None:
    """kvbatch's kernel profile over one more run of `draw` (KernelProfile.to_dict), compared
    with the median of its timed runs; a profiler failure becomes a warning, not a lost run."""
    reference = statistics.median(r.seconds for r in runs) if runs else None
    try:
        profile = profile_engine_run(
            peer.llm.engine, lambda: run_once(peer, workload, draw), reference
        )
    except Exception as e:  # the timed results stand without it
        warnings.append(f"kernel profile failed: {type(e).__name__}: {e}")
        return None
    if profile.device == "cuda" and not profile.top:  # e.g. CUPTI collecting nothing
        warnings.append("kernel profile traced no kernel: its busy share says nothing")
    return profile.to_dict()


def _paired_ratio(runs: list[RunResult], reference: list[RunResult]) -> float | None:
    """Median over rounds of this engine's seconds / the reference's seconds in that round."""
    ratios = [a.seconds / b.seconds for a, b in zip(runs, reference) if b.seconds > 0]
    return statistics.median(ratios) if ratios else None


def engine_order(peers: Sequence[str], include_kvbatch: bool = True) -> tuple[str, ...]:
    """kvbatch first (the reference), then each peer once, in the order given."""
    names = [KVBATCH] if include_kvbatch else []
    for p in peers:
        if p not in names:
            names.append(p)
    return tuple(names)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"

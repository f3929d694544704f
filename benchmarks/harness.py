"""Side-by-side benchmark: kvbatch and its peers on the same prompts, in one process.

Machines are noisy, so figures are only compared within one run: every engine runs here one
after the other, with the same prompts and the same torch thread count, and the table quotes
each engine's time as a ratio to kvbatch's. Per engine:

    load (not timed) -> warm-up (not timed) -> `repeat` timed runs -> free the model

Repeat r uses the workload drawn with seed `seed + r` (the same for every engine), so a prefix
cache warmed by one repeat cannot serve the next. Seconds are the median over the repeats.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers import EngineOptions, RunResult, make_peer
from benchmarks.workloads import SMOLLM2, Workload, make_prompts

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
        return self.config.engines[0]

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

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what `--json` writes)."""
        c = self.config
        return {
            "workload": c.workload.to_dict(),
            "model_path": c.model_path,
            "options": dataclasses.asdict(c.options),
            "repeat": c.repeat,
            "reference": self.reference,
            "engines": [dataclasses.asdict(s) for s in self.engines],
            "prefix_hit_rate": self.prefix_hit_rate,
            "cached_token_fraction": self.cached_token_fraction,
            "greedy_match": [dataclasses.asdict(m) for m in self.greedy_match],
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
        rows = [("engine", "seconds", "output tok/s", "ratio", "greedy match")]
        for s in self.engines:
            g = matches.get(s.engine)
            match = "reference" if s.engine == self.reference else "-"
            if g is not None:
                match = f"{g.matching}/{g.compared}"
            ratio = "-" if s.ratio is None else f"{s.ratio:.2f}"
            rows.append((s.engine, f"{s.seconds:.2f}", f"{s.tokens_per_s:.1f}", ratio, match))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            cells = [r[0].ljust(widths[0])] + [v.rjust(w) for v, w in zip(r[1:], widths[1:])]
            lines.append("  ".join(cells).rstrip())
        lines.append("")
        kv = self.summary(KVBATCH)
        if kv is not None:
            rate = self.prefix_hit_rate
            x = kv.extra
            lines.append(
                f"kvbatch prefix cache: hit rate {_fmt(rate)} (engine counters, last run); "
                f"{x.get('cached_prompt_tokens')} of {x.get('prompt_tokens')} prompt tokens "
                f"cached ({_fmt(self.cached_token_fraction)}) in the last run"
            )
        lines.append(
            f"ratio = median over rounds of engine seconds / {self.reference} seconds "
            f"(how many times faster {self.reference} is)"
        )
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def resolve_model(workload: Workload, model: str | Path | None = None) -> str:
    """The model path to benchmark: `model` if given, else the workload's default weights."""
    if model is not None:
        path = Path(model).expanduser()
        if not path.exists():
            raise BenchError(f"--model {model}: no such file or folder")
        return str(path)
    if workload.model == SMOLLM2:
        from engine.fetch import smollm2_dir

        return str(smollm2_dir())
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


def machine_info(device: str) -> dict[str, Any]:
    """What the figures were measured on."""
    import transformers

    if device.startswith("cuda") and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(torch.device(device))
    else:
        device_name = _cpu_model() or platform.processor() or "unknown cpu"
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = None
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "device_name": device_name,
    }


def run_benchmark(
    config: BenchConfig, progress: Callable[[str], None] | None = None
) -> BenchReport:
    """Run every engine of `config` on the workload, one after the other, and compare them."""
    say = progress or (lambda _msg: None)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    w = config.workload
    vocab_size = model_vocab_size(config.model_path)
    draws = [make_prompts(w.with_seed(w.seed + r), vocab_size) for r in range(config.repeat)]

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
            except ImportError as e:
                raise BenchError(f"cannot import engine {name!r}: {e}") from e
            peers[name] = peer
            say(f"{name}: warm-up")
            peer.warmup()
        for r, prompts in enumerate(draws):
            for name, peer in peers.items():
                say(f"{name}: run {r + 1}/{config.repeat} ({w.num_requests} requests)")
                results[name].append(peer.run(prompts, w.output_len))
                say(f"{name}: {results[name][-1].seconds:.2f} s")
    finally:
        for peer in peers.values():
            peer.close()

    reference = config.engines[0]
    summaries = []
    warnings = []
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
                extra=runs[-1].extra,
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
        machine=machine_info(config.options.device),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        warnings=warnings,
    )


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


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None

"""`kvbatch bench WORKLOAD --sweep`: kvbatch alone over a grid of its two scheduling knobs and
the KV pool size, throughput and latency side by side.

    max_num_seqs x max_num_batched_tokens x kv_cache_memory_fraction

More sequences and bigger steps raise throughput until the KV pool or the GPU is full, and
raise every request's time per output token on the way (each step does more work); a bigger
pool admits more sequences at once. The table shows both sides per cell, so a user picks the
cell that fits the job's throughput / latency / cost trade-off.

Each cell builds its own engine (the previous one is freed and the CUDA cache emptied first:
the pool is sized from free memory), warms it up, and runs the workload `repeat` times. A cell
that cannot run (a pool too small for the model's context, out of memory) records its error
and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvbatch.bench.harness import (
    KVBATCH,
    LATENCY_HEADERS,
    BenchConfig,
    BenchError,
    draw_prompts,
    format_long_prefill,
    latency_cells,
    latency_summary,
    long_prefill_summary,
    model_vocab_size,
    run_once,
    warm_up,
)
from kvbatch.bench.machine import machine_info
from kvbatch.bench.peers import make_peer
from kvbatch.bench.text_table import format_rows

DEFAULT_MAX_NUM_SEQS = (128, 256, 512)
DEFAULT_BATCHED_TOKENS = (4096, 8192, 16384)
DEFAULT_KV_FRACTIONS = (0.85, 0.90, 0.92)


def parse_list(text: str, kind: Callable[[str], Any], flag: str) -> tuple:
    """`"128,256"` -> (128, 256); the error names the flag."""
    try:
        values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: give at least one value")
    return values


@dataclass(frozen=True)
class SweepGrid:
    max_num_seqs: tuple[int, ...] = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: tuple[int, ...] = DEFAULT_BATCHED_TOKENS
    kv_cache_memory_fraction: tuple[float, ...] = DEFAULT_KV_FRACTIONS

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_fraction"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"sweep {name}: give at least one value")
            if len(set(values)) != len(values):
                raise ValueError(f"sweep {name}: values listed twice: {values}")
        if min(self.max_num_seqs) < 1 or min(self.max_num_batched_tokens) < 1:
            raise ValueError("sweep max_num_seqs and max_num_batched_tokens must be >= 1")
        if not all(0.0 < f <= 1.0 for f in self.kv_cache_memory_fraction):
            raise ValueError("sweep kv_cache_memory_fraction values must be in (0, 1]")

    def cells(self) -> list[tuple[int, int, float]]:
        """Every (max_num_seqs, max_num_batched_tokens, kv_cache_memory_fraction), in order."""
        return list(
            itertools.product(
                self.max_num_seqs, self.max_num_batched_tokens, self.kv_cache_memory_fraction
            )
        )

    def for_device(self, device: str) -> SweepGrid:
        """On the CPU the KV pool has a fixed byte size, so the fraction changes nothing: one
        value is kept instead of running identical cells."""
        if device.startswith("cuda"):
            return self
        return dataclasses.replace(self, kv_cache_memory_fraction=self.kv_cache_memory_fraction[:1])


@dataclass
class SweepCell:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory_fraction: float
    seconds: float | None = None  # median over repeats
    tokens_per_s: float | None = None
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    num_kv_blocks: int | None = None
    num_preemptions: int | None = None
    long_prefill: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class SweepReport:
    config: BenchConfig
    grid: SweepGrid
    cells: list[SweepCell]
    machine: dict[str, Any]
    date: str
    warnings: list[str]

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "kind": "sweep",
            "workload": c.workload.to_dict(),
            "model_path": c.model_path,
            "options": dataclasses.asdict(c.options),
            "repeat": c.repeat,
            "grid": dataclasses.asdict(self.grid),
            "cells": [dataclasses.asdict(cell) for cell in self.cells],
            "warnings": list(self.warnings),
            "machine": self.machine,
            "date": self.date,
            "command": c.command,
        }

    def best(self) -> tuple[SweepCell | None, SweepCell | None]:
        """The cell with the highest throughput and the one with the lowest TPOT p99."""
        ok = [c for c in self.cells if c.error is None and c.seconds is not None]
        fastest = max(ok, key=lambda c: c.tokens_per_s or 0.0, default=None)
        timed = [c for c in ok if c.tpot_p99 is not None]
        steadiest = min(timed, key=lambda c: c.tpot_p99, default=None)
        return fastest, steadiest

    def format_table(self) -> str:
        c = self.config
        m = self.machine
        lines = [
            c.workload.summary(),
            f"kvbatch sweep on {m['device']} ({m['device_name']}), {c.repeat} run(s) per cell, "
            f"{self.date}",
            "",
        ]
        long = any(cell.long_prefill for cell in self.cells)
        head = ["seqs", "tokens/step", "kv frac", "seconds", "output tok/s"] + LATENCY_HEADERS
        head += ["gap ratio"] if long else []
        rows = [tuple(head + ["kv blocks", "note"])]
        for cell in self.cells:
            row = [
                str(cell.max_num_seqs),
                str(cell.max_num_batched_tokens),
                f"{cell.kv_cache_memory_fraction:.2f}",
            ]
            if cell.error is not None:
                rows.append(tuple(row + ["-"] * (len(head) - 3) + ["-", _short(cell.error)]))
                continue
            row += [f"{cell.seconds:.2f}", f"{cell.tokens_per_s:.1f}"] + latency_cells(cell)
            if long:
                ratio = (cell.long_prefill or {}).get("gap_ratio")
                row.append("-" if ratio is None else f"{ratio:.1f}")
            blocks = "-" if cell.num_kv_blocks is None else str(cell.num_kv_blocks)
            note = "" if not cell.num_preemptions else f"{cell.num_preemptions} preemptions"
            rows.append(tuple(row + [blocks, note]))
        lines += format_rows(rows)
        lines.append("")
        lines.append("TTFT / TPOT in ms (p50, p99 over requests)")
        fastest, steadiest = self.best()
        if fastest is not None:
            lines.append(f"highest throughput: {_cell_name(fastest)}")
        if steadiest is not None:
            lines.append(f"lowest TPOT p99:    {_cell_name(steadiest)}")
        for cell in self.cells:
            if cell.long_prefill is not None:
                lines.append(format_long_prefill(f"[{_cell_name(cell)}]", cell.long_prefill))
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def run_sweep(
    config: BenchConfig, grid: SweepGrid, progress: Callable[[str], None] | None = None
) -> SweepReport:
    """Run kvbatch on `config`'s workload once per cell of `grid`."""
    say = progress or (lambda _msg: None)
    if config.engines != (KVBATCH,):
        raise BenchError("--sweep runs kvbatch alone: drop --peers and --skip-kvbatch")
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    w = config.workload
    warnings = []
    device = config.options.device
    effective = grid.for_device(device)
    if effective != grid:
        warnings.append(
            "kv_cache_memory_fraction sizes the KV pool on CUDA only: on the CPU one value "
            f"({effective.kv_cache_memory_fraction[0]:g}) was kept"
        )
    vocab_size = model_vocab_size(config.model_path)
    draws = draw_prompts(w, vocab_size, config.repeat)
    cells = []
    for i, (seqs, tokens, fraction) in enumerate(effective.cells(), 1):
        cell = SweepCell(seqs, tokens, fraction)
        say(f"cell {i}/{len(effective.cells())}: {_cell_name(cell)}")
        options = dataclasses.replace(
            config.options,
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
            kv_cache_memory_fraction=fraction,
        )
        peer = make_peer(KVBATCH, config.model_path, options)
        try:
            peer.load()
            warm_up(peer, config, vocab_size)  # on CUDA: the whole workload, once per cell
            runs = [run_once(peer, w, draw) for draw in draws]
            seconds = statistics.median(r.seconds for r in runs)
            cell.seconds = seconds
            cell.tokens_per_s = runs[-1].output_tokens / seconds if seconds > 0 else None
            for key, value in latency_summary(runs).items():
                setattr(cell, key, value)
            cell.long_prefill = long_prefill_summary(runs)
            stats = runs[-1].extra.get("stats", {})
            cell.num_kv_blocks = stats.get("num_kv_blocks")
            cell.num_preemptions = stats.get("num_preemptions")
            say(f"  {seconds:.2f} s")
        except (ValueError, RuntimeError) as e:  # includes torch.OutOfMemoryError
            cell.error = f"{type(e).__name__}: {e}"
            say(f"  failed: {cell.error}")
        finally:
            peer.close()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        cells.append(cell)
    return SweepReport(
        config=config,
        grid=effective,
        cells=cells,
        machine=machine_info(device),
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        warnings=warnings,
    )


def _cell_name(cell: SweepCell) -> str:
    return (
        f"max_num_seqs {cell.max_num_seqs}, max_num_batched_tokens "
        f"{cell.max_num_batched_tokens}, kv_cache_memory_fraction "
        f"{cell.kv_cache_memory_fraction:.2f}"
    )


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

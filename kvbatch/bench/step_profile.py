"""Where an engine step's time goes: wall time of each phase of every `LLMEngine.step`.

    schedule   Scheduler.schedule: which sequences run, block allocation
    prepare    ModelRunner._prepare: token ids, positions, slots, block tables, cascade groups,
               the host-to-device copy
    forward    the model call: on a GPU only the kernel launches (or one graph replay), since
               the GPU runs ahead of the host
    sample     the sampler and the tokens' trip back to the host: on a GPU this is where the
               host waits for the step's kernels to finish (with async scheduling, for the
               previous step's, while this one runs)
    rest       appending tokens, stop checks, finishing requests

Without async scheduling, schedule + prepare + rest is host time the GPU cannot hide (the
next step starts only when the host has it ready); with it, the GPU runs one step while the
host does these for the next. The profile wraps the engine's methods in place; it costs a
few `perf_counter` calls per step. It also records the cycle collector's passes
(bench/gc_pauses.py): a full pass is a stall no phase accounts for.

`last` describes the latest step for a caller that wants one slow step explained (the
long-prefill run's slowest steps): its phases, the device time of the step it collected (with
async scheduling, the one before it; timed only when the engine times its steps) and the CUDA
graph it replayed. A step that waited long in `sample` waited for the device; one long in
schedule, prepare or rest lost the time on the host.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvbatch.bench.gc_pauses import GCPauses, format_gc_pauses

PHASES = ("schedule", "prepare", "forward", "sample", "rest")
HOST_PHASES = ("schedule", "prepare", "rest")


class StepProfile:
    def __init__(self, engine: Any) -> None:
        self.steps: list[dict[str, float]] = []  # seconds per phase, steps that ran the model
        self.graph_steps = 0
        self.mixed_graph_steps = 0  # of those, decodes with a prompt chunk
        self.graph_captures = 0  # of those, steps that captured their graph (first use)
        self.graph_first_launches = 0  # of those, the first replay of a captured graph
        self.gc = GCPauses().start()
        self.last: dict[str, Any] | None = None  # the latest step that ran the model
        self._step: dict[str, Any] = {}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "_prepare", "prepare")
        self._wrap(engine.runner, "_forward", "forward")
        self._wrap(engine.runner, "launch", "launch")
        self._wrap(engine, "_collect", "collect")
        inner_collect, inner_step = engine._collect, engine.step

        def collect(launched):
            result = inner_collect(launched)
            self._step["device"] = launched.seconds  # its events have completed by now
            return result

        engine._collect = collect

        def step(*args, **kwargs):
            self._step, self.last = {}, None
            start = time.perf_counter()
            try:
                return inner_step(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                t = self._step
                if "launch" in t:  # a step that scheduled nothing never reached the model
                    collect = t.get("collect", 0.0)  # async: the first step collects nothing
                    phases = {
                        "schedule": t["schedule"],
                        "prepare": t["prepare"],
                        "forward": t["forward"],
                        "sample": t["launch"] - t["prepare"] - t["forward"] + collect,
                        "rest": total - t["launch"] - collect - t["schedule"],
                    }
                    self.steps.append(phases)
                    device = t.get("device")
                    self.last = {f"{k}_ms": round(v * 1e3, 3) for k, v in phases.items()} | {
                        "collected_device_ms": None if device is None else round(device * 1e3, 3),
                        "graph": t.get("graph"),
                    }

        engine.step = step
        graphs = engine.runner.step_graphs
        if graphs is not None:
            replay = graphs.run

            def counted(key, *args, **kwargs):
                # a graph's first replay also uploads it (engine/exec/cuda_graphs.py _launch_new)
                first = key in graphs.graphs and not graphs.launches[key]
                self._step["graph"] = graph_label(key, first_launch=first)
                self.graph_first_launches += first
                self.graph_steps += 1
                self.mixed_graph_steps += bool(key.chunk)
                before = graphs.first_use_captures
                try:
                    return replay(key, *args, **kwargs)
                finally:
                    self.graph_captures += graphs.first_use_captures - before

            graphs.run = counted

    def _wrap(self, obj: Any, name: str, key: str) -> None:
        """obj.name runs once per step: its wall time goes into the current step's record."""
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._step[key] = time.perf_counter() - start

        setattr(obj, name, timed)

    def clear(self) -> None:
        self.steps.clear()
        self.graph_steps = self.mixed_graph_steps = self.graph_captures = 0
        self.graph_first_launches = 0
        self.gc.clear()

    def summary(self) -> dict[str, Any]:
        """Median milliseconds per phase (robust to a step the machine interrupted), the mean
        host milliseconds per step, steps run and steps that replayed a CUDA graph (decodes
        alone or with a prompt chunk, and those that captured it: the first step of a pair of
        buckets waits for a capture, which a timed run should not hold; and those that were a
        captured graph's first replay, which uploads it)."""
        if not self.steps:
            return {
                "steps": 0,
                "graph_steps": 0,
                "mixed_graph_steps": 0,
                "graph_captures": 0,
                "graph_first_launches": 0,
                "ms_per_step": {},
                "host_ms_per_step": None,
                "gc": self.gc.summary(),
            }
        host = [sum(s[k] for k in HOST_PHASES) for s in self.steps]
        return {
            "steps": len(self.steps),
            "graph_steps": self.graph_steps,
            "mixed_graph_steps": self.mixed_graph_steps,
            "graph_captures": self.graph_captures,
            "graph_first_launches": self.graph_first_launches,
            "ms_per_step": {k: statistics.median(s[k] for s in self.steps) * 1e3 for k in PHASES},
            "host_ms_per_step": statistics.mean(host) * 1e3,
            "host_seconds": sum(host),
            "gc": self.gc.summary(),
        }


def graph_label(key: Any, first_launch: bool = False) -> str:
    """A step's CUDA graph in words, from its engine/cuda_graphs.GraphKey; `first_launch`:
    the graph's first replay, which also uploads it to the device."""
    text = f"{key.rows} decodes"
    if key.chunk:
        text += f" + a {key.chunk}-token chunk"
    if key.wide:
        text += ", wide tables"
    if key.cascade:
        text += ", shared-prefix groups"
    if first_launch:
        text += ", its first launch"
    return text


def format_step_profile(p: dict[str, Any], engine: str = "kvbatch") -> str:
    ms = p["ms_per_step"]
    gc_text = f"; {format_gc_pauses(p['gc'])}" if p.get("gc") else ""  # older results lack it
    return (
        f"{engine} steps (last run): {p['steps']}, {p['graph_steps']} replayed a CUDA graph "
        f"({p.get('mixed_graph_steps', 0)} with a prompt chunk, "
        f"{p.get('graph_captures', 0)} captured in the run, "
        f"{p.get('graph_first_launches', 0)} launched for the first time); "
        f"median ms per step: schedule {ms['schedule']:.2f}, prepare {ms['prepare']:.2f}, "
        f"forward {ms['forward']:.2f}, sample {ms['sample']:.2f}, rest {ms['rest']:.2f}; "
        f"host time {p['host_seconds']:.2f} s in all (schedule + prepare + rest; the GPU "
        f"runs meanwhile only with async scheduling){gc_text}"
    )

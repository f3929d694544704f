"""Where kvbatch's device time goes: one more run under `torch.profiler`, kernels ranked.

    kvbatch bench rag --kernel-profile

The timed runs say how long the job took; this says what the GPU spent that time on, so one
run on a lent GPU shows which kernel to work on next. After the timed runs kvbatch runs a draw
of its own (harness.PROFILE_SEED_OFFSET: no prompt, so no prefix-cache block, in common with
the timed runs) with the profiler on (its figures are not used for the table's seconds), and
the report gets:

- busy: the kernels' summed device time against the *unprofiled* run's seconds. Near 100% the
  job is bound by its kernels; well below, the GPU waits for the host (Python per step).
- steps by kind (decode, prefill, mixed: what `Scheduler.schedule` gave the runner): how many,
  host milliseconds per step inside `ModelRunner.launch`, and on a GPU the span of the
  kernels each step launched (the profiler's GPU-side range of the step's annotation).
- kinds: seconds per kind of kernel (GEMM, prefill attention, decode attention, ...), named
  from the kernel names of kvbatch.kernels/ and cuBLAS's;
- top kernels: calls, total and mean time, share of all kernel time.

On the CPU (tests, `--tiny`) nothing runs on a device: operators are ranked by their self CPU
time instead and the busy share is theirs, which keeps the same path tested.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from kvbatch.bench.text_table import format_rows

ANNOTATION = "kvbatch."  # record_function names this module adds: kvbatch.<step kind>

# (kind, substrings of a lowercased kernel or operator name); the first match wins
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention (prefill)", ("_prefill_kernel",)),
    ("attention (decode)", ("_decode_split_kernel", "_merge_splits_kernel", "_merge_kernel")),
    ("norm, rotary, act, kv write", ("_rms_norm", "_rotary", "_act_and_mul", "_write_kv")),
    (
        "gemm",
        ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm"),
    ),
    ("copy", ("memcpy", "memset", "aten::copy_", "aten::index")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


class Record(NamedTuple):
    """One profiler event, reduced to what the summary needs (times in microseconds).
    `self_us` is the event's own time: a kernel's duration, an operator's self CPU time."""

    name: str
    on_device: bool
    self_us: float
    total_us: float


@dataclass
class KernelRow:
    name: str
    kind: str
    calls: int
    seconds: float
    share: float  # of all kernel (or operator) time


@dataclass
class StepKind:
    steps: int
    host_ms_per_step: float  # inside ModelRunner.launch: prepare, forward's launches, sampler
    device_ms_per_step: float | None  # the span of the step's kernels on the GPU; None on CPU


@dataclass
class KernelProfile:
    device: str  # "cuda": kernels by device time; "cpu": operators by self CPU time
    profiled_seconds: float  # the profiled run's wall time (the profiler's overhead included)
    busy_seconds: float  # all kernels' device time (CPU: all operators' self time)
    reference_seconds: float | None = None  # the unprofiled run's seconds, to compare with
    by_kind: dict[str, float] = field(default_factory=dict)  # seconds per kernel kind
    steps: dict[str, StepKind] = field(default_factory=dict)
    top: list[KernelRow] = field(default_factory=list)

    @property
    def busy_fraction(self) -> float | None:
        base = self.reference_seconds or self.profiled_seconds
        return self.busy_seconds / base if base > 0 else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["busy_fraction"] = self.busy_fraction
        return d


def summarize(
    records: Iterable[Record],
    device: str,
    profiled_seconds: float,
    reference_seconds: float | None = None,
    top: int = 12,
) -> KernelProfile:
    """Aggregate profiler records: kernels (device records, or CPU operators when the run had
    no device) by name and kind, and the step annotations by step kind."""
    on_gpu = device != "cpu"
    calls: dict[str, int] = defaultdict(int)
    own: dict[str, float] = defaultdict(float)
    host: dict[str, list[float]] = defaultdict(list)  # step kind -> host us per step
    span: dict[str, list[float]] = defaultdict(list)  # step kind -> device us per step
    for r in records:
        if r.name.startswith(ANNOTATION):
            kind = r.name[len(ANNOTATION) :]
            (span if r.on_device else host)[kind].append(r.total_us)
        elif r.on_device == on_gpu:
            calls[r.name] += 1
            own[r.name] += r.self_us
    busy_us = sum(own.values())
    by_kind: dict[str, float] = defaultdict(float)
    for name, us in own.items():
        by_kind[kernel_kind(name)] += us / 1e6
    ranked = sorted(own, key=own.__getitem__, reverse=True)[:top]
    rows = [
        KernelRow(n, kernel_kind(n), calls[n], own[n] / 1e6, own[n] / busy_us if busy_us else 0.0)
        for n in ranked
    ]
    steps = {
        kind: StepKind(
            steps=len(us),
            host_ms_per_step=sum(us) / len(us) / 1e3,
            device_ms_per_step=sum(span[kind]) / len(span[kind]) / 1e3 if span[kind] else None,
        )
        for kind, us in sorted(host.items())
    }
    return KernelProfile(
        device="cuda" if on_gpu else "cpu",
        profiled_seconds=profiled_seconds,
        busy_seconds=busy_us / 1e6,
        reference_seconds=reference_seconds,
        by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        steps=steps,
        top=rows,
    )


def step_kind(out: Any) -> str:
    """decode (every chunk one token), prefill (no decode), or mixed."""
    ones = sum(1 for c in out.chunks if c.num_new_tokens == 1)
    if ones == len(out.chunks):
        return "decode"
    return "prefill" if ones == 0 else "mixed"


def profile_engine_run(
    engine: Any, run: Callable[[], Any], reference_seconds: float | None = None, top: int = 12
) -> KernelProfile:
    """Run `run()` (which drives `engine`) under torch.profiler and summarize it. Every
    `ModelRunner.launch` is annotated with its step kind for the time of the run."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    device = engine.runner.device
    on_gpu = device.type == "cuda"
    runner = engine.runner
    launch = runner.launch

    def annotated(out, *args, **kwargs):
        with record_function(ANNOTATION + step_kind(out)):
            return launch(out, *args, **kwargs)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    runner.launch = annotated
    try:
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            run()
            if on_gpu:
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
    finally:
        runner.launch = launch  # as it was (the class's method, or a StepProfile's wrapper)
    records = _records(prof, on_gpu)
    return summarize(records, "cuda" if on_gpu else "cpu", seconds, reference_seconds, top)


def _records(prof: Any, on_gpu: bool) -> list[Record]:
    """The profiler's events as Records. On a GPU: every kernel, memcpy and memset (one
    record per launch) plus the annotations; on the CPU: operators with their self time."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        device = e.device_type != DeviceType.CPU
        if device:  # a kernel, copy or the GPU-side span of an annotation
            us = float(e.time_range.elapsed_us())
            out.append(Record(e.name, True, us, us))
        elif e.name.startswith(ANNOTATION) or not on_gpu:
            out.append(Record(e.name, False, float(e.self_cpu_time_total), float(e.cpu_time_total)))
    return out


def format_kernel_profile(p: dict[str, Any], engine: str = "kvbatch") -> str:
    """The profile (KernelProfile.to_dict) as text: busy share, steps, kinds, top kernels."""
    what = "kernels" if p["device"] == "cuda" else "operators (self CPU time)"
    ref = p.get("reference_seconds")
    busy = p.get("busy_fraction")
    share = f" = {busy:.0%} of the unprofiled run's {ref:.2f} s" if ref and busy is not None else ""
    lines = [
        f"{engine} kernel profile (one more run under torch.profiler, {p['device']}; "
        f"{p['profiled_seconds']:.2f} s with the profiler on): {what} {p['busy_seconds']:.3f} s"
        f"{share}"
    ]
    steps = []
    for kind, s in p["steps"].items():
        gpu = s["device_ms_per_step"]
        gpu_txt = "" if gpu is None else f", GPU span {gpu:.2f} ms"
        steps.append(f"{kind} {s['steps']} (host {s['host_ms_per_step']:.2f} ms{gpu_txt})")
    if steps:
        lines.append("  steps: " + "; ".join(steps))
    total = p["busy_seconds"] or 1.0
    kinds = ", ".join(f"{k} {v:.3f} s ({v / total:.0%})" for k, v in p["by_kind"].items())
    lines.append(f"  by kind: {kinds}")
    rows = [("kernel" if p["device"] == "cuda" else "operator", "calls", "ms", "share", "kind")]
    for r in p["top"]:
        name = r["name"] if len(r["name"]) <= 60 else r["name"][:57] + "..."
        ms = f"{r['seconds'] * 1e3:.1f}"
        rows.append((name, str(r["calls"]), ms, f"{r['share']:.0%}", r["kind"]))
    lines += ["  " + line for line in format_rows(rows)]
    return "\n".join(lines)

"""The long-prefill run: decoders stream tokens while a long prompt is prefilled in chunks.

    decoders:     d d d d d d d d d d d d d d d d d ...
    long prompt:          ^ added once each decoder has `long_prompt_after` tokens
    steps:        plain | plain | mixed (chunk + decodes) ... mixed | plain | plain
                                  \\__ prefill steps: the long prompt has no token yet __/

The target: no decoder waits more than three decode steps' time for its next
token. The longest wait is the engine's own figure (RequestMetrics.max_token_gap); the
decode step it is compared with is the median wall time of the *plain* decode steps, those
with no prefill work in them. (The median of all token gaps would not do: with a small
chunk cap most steps are mixed, and that median grows with the gap it should measure, so
it would call a gap of ten plain steps "met".)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbatch.bench.gc_pauses import GCPauses
from kvbatch.bench.step_profile import PHASES

LONGEST_STEPS = 5  # how many of the slowest steps the figures list


@dataclass
class LongPrefillRun:
    outputs: list[Any]  # the decoders' RequestOutputs, in prompt order
    seconds: float
    figures: dict[str, Any]


def drive_long_prefill(
    engine: Any,
    prompts: list[list[int]],
    long_prompt: list[int],
    workload: Any,
    params: Callable[[int], Any],
    synchronize: Callable[[], None] = lambda: None,
    step_detail: Callable[[], dict[str, Any] | None] = lambda: None,
) -> LongPrefillRun:
    """Drive `engine` step by step through the long-prefill job and measure it.

    Every step is timed (from one `engine.step()` return to the next, the first from the
    start) and labelled from the requests' state before the call: plain when every decoder
    had its first token and the long prompt was either not yet added or had its first
    token; prefill while the long prompt had none. Exact without async scheduling; with it
    (on CUDA) a call launches one step and returns the tokens of the one before, so the
    first call labelled prefill in fact times a plain decode step (one step in tens). When no
    step is plain the reference falls back to the median gap between consecutive decoder
    tokens; `decode_step_reference` says which was used.

    `step_detail`, called after each step (benchmarks/step_profile.StepProfile.last), explains
    the slowest steps in `longest_steps`: host phases, the collected step's device time and
    the graph the step replayed.
    """
    # the collector's passes over the run; a run that raises leaves an idle callback behind
    pauses = GCPauses().start()
    tag = f"long-prefill-{time.monotonic_ns()}"
    start = time.perf_counter()
    ids = [
        engine.add_request(p, params(workload.output_len), request_id=f"{tag}-{i}")
        for i, p in enumerate(prompts)
    ]
    seqs = {rid: engine.requests[rid] for rid in ids}
    seen = dict.fromkeys(ids, 0)
    token_times: dict[str, list[float]] = {rid: [] for rid in ids}
    finished: dict[str, Any] = {}
    long_id: str | None = None
    long_seq: Any = None  # engine.requests drops a request when it finishes: keep it
    # every step's wall seconds, its kind (_step_kind) and step_detail's account of it
    steps: list[tuple[float, str, dict[str, Any] | None]] = []
    arrival = 0
    first_long_token: float | None = None
    last = start
    while engine.has_unfinished():
        prefilling = long_seq is not None and long_seq.num_output_tokens == 0
        decoding = min(seen.values()) > 0 and not prefilling
        done = engine.step()
        now = time.perf_counter()
        step_s, last = now - last, now
        steps.append((step_s, _step_kind(prefilling, decoding, long_seq), step_detail()))
        for rid, seq in seqs.items():
            n = seq.num_output_tokens
            if n > seen[rid]:
                token_times[rid] += [now] * (n - seen[rid])
                seen[rid] = n
        if first_long_token is None and long_seq is not None and long_seq.num_output_tokens:
            first_long_token = now
        for out in done:
            finished[out.request_id] = out
        if long_id is None and min(seen.values()) >= workload.long_prompt_after:
            long_params = params(workload.long_output_len)
            long_id = engine.add_request(long_prompt, long_params, request_id=f"{tag}-long")
            long_seq = engine.requests[long_id]
            arrival = now
    synchronize()
    seconds = time.perf_counter() - start
    pauses.stop()
    if long_id is None:
        raise RuntimeError("the decoders finished before the long prompt was added")
    outs = [finished[rid] for rid in ids]
    gaps = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
    # the waits that overlap the long prompt's prefill (from its arrival to its first token)
    first_long_token = first_long_token or seconds + start
    prefilling_gaps = [
        b - a
        for times in token_times.values()
        for a, b in zip(times, times[1:])
        if b > arrival and a < first_long_token
    ]
    engine_gaps = [o.metrics.max_token_gap for o in outs if o.metrics is not None]
    max_gap = max(engine_gaps) if engine_gaps else max(gaps, default=0.0)
    # the plain decode steps (the long request's decodes too) and the prefill's steps
    decode_steps = [t for t, kind, _ in steps if kind in ("plain", "long decoding")]
    prefill_steps = [t for t, kind, _ in steps if kind == "prefilling"]
    if decode_steps:
        median_step, reference = statistics.median(decode_steps), "plain decode steps"
    else:
        median_step = statistics.median(gaps) if gaps else None
        reference = "all token gaps"
    long_out = finished[long_id]
    long_ttft = None
    if long_out.metrics is not None and long_out.metrics.time_to_first_token is not None:
        long_ttft = long_out.metrics.time_to_first_token
    figures = {
        "max_token_gap_s": max_gap,
        "max_token_gap_observed_s": max(gaps, default=0.0),
        "median_decode_step_s": median_step,
        "decode_step_reference": reference,
        "median_prefill_step_s": statistics.median(prefill_steps) if prefill_steps else None,
        "prefill_steps": len(prefill_steps),
        "gap_ratio": max_gap / median_step if median_step else None,
        "max_token_gap_prefilling_s": max(prefilling_gaps, default=None),
        "prefilling_gap_ratio": (
            max(prefilling_gaps) / median_step if median_step and prefilling_gaps else None
        ),
        "long_prompt_tokens": len(long_prompt),
        "long_prompt_arrival_s": arrival - start,
        "long_prompt_ttft_s": long_ttft,
        "steps": len(steps),
        # where to look when the gap is long: the slowest steps, their index and kind
        "longest_steps": [
            {"step": i, "ms": round(steps[i][0] * 1000, 3), "kind": steps[i][1]}
            | ({"detail": steps[i][2]} if steps[i][2] else {})
            for i in sorted(range(len(steps)), key=lambda i: -steps[i][0])[:LONGEST_STEPS]
        ],
        # what the engine's step cost model learned (engine/sched/step_cost.py), when it timed steps
        "step_cost": cost.describe() if (cost := getattr(engine, "step_cost", None)) else None,
        # the cycle collector's passes (bench/gc_pauses.py): was the longest gap one?
        "gc": pauses.summary()
        | {"longest_pause_prefilling_s": pauses.longest(arrival, first_long_token)},
    }
    return LongPrefillRun(outs, seconds, figures)


def _step_kind(prefilling: bool, decoding: bool, long_seq: Any) -> str:
    """A step's label for `longest_steps`: "start" (a decoder still had no token),
    "prefilling" (the long prompt had none), "long decoding" (a plain step that decodes the
    long request too, at its long context) or "plain"."""
    if prefilling:
        return "prefilling"
    if not decoding:
        return "start"
    if long_seq is not None and long_seq.num_output_tokens and not long_seq.is_finished:
        return "long decoding"
    return "plain"


def longest_steps_text(f: dict[str, Any]) -> str:
    """The slowest steps for the one-line reports ("" when the figures have none)."""
    longest = f.get("longest_steps") or []
    return ", ".join(
        f"{s['ms']:.1f} ms (step {s['step']}, {s['kind']}{_detail_text(s.get('detail'))})"
        for s in longest
    )


def _detail_text(d: dict[str, Any] | None) -> str:
    """A slow step explained, after its kind: host = schedule + prepare + forward + rest,
    waiting = sample (the sampler's launch and the wait for the collected step's tokens),
    then the collected step's device time and the graph replayed, when known."""
    if not d:
        return ""
    host = sum(d[f"{k}_ms"] for k in PHASES if k != "sample")
    text = f"; host {host:.1f} ms, waiting {d['sample_ms']:.1f} ms"
    if d.get("collected_device_ms") is not None:
        text += f", collected step {d['collected_device_ms']:.1f} ms on the device"
    if d.get("graph"):
        text += f", graph of {d['graph']}"
    return text


def padding_text(cost: dict[str, Any]) -> str:
    """How much the mixed steps' CUDA graphs padded the chunks ("" when they did not)."""
    tokens, rows = cost.get("mixed_tokens"), cost.get("mixed_rows")
    if not tokens or not rows or rows <= tokens:
        return ""
    return f", chunks padded to graph buckets: {rows / tokens - 1:.0%} more rows than tokens"


def reference_and_prefill_text(f: dict[str, Any]) -> tuple[str, str]:
    """For the one-line reports (the bench table's and the GPU check's summary, which runs on
    the standard library alone): what `median_decode_step_s` is the median of, and the
    prefill steps' part ("" when the figures have none). Results written before the plain
    decode step was timed lack `decode_step_reference`: their median is named as measured."""
    name = {
        "plain decode steps": "plain decode step",
        "all token gaps": "median token gap (no plain decode step)",
    }.get(f.get("decode_step_reference"), "median decode step")
    prefill = ""
    if f.get("prefill_steps"):
        median = f.get("median_prefill_step_s")
        ms = "-" if median is None else f"{median * 1000:.1f}"
        prefill = f"; steps while prefilling: {f['prefill_steps']}, median {ms} ms"
    gap, ratio = f.get("max_token_gap_prefilling_s"), f.get("prefilling_gap_ratio")
    if gap is not None and ratio is not None:
        prefill += f"; longest gap while prefilling {gap * 1000:.1f} ms (ratio {ratio:.1f})"
    if gc_figures := f.get("gc"):
        pause = gc_figures.get("longest_pause_prefilling_s")
        prefill += (
            f"; {gc_figures['full_passes']} full GC passes in the run, longest GC pause while "
            f"prefilling {'-' if pause is None else f'{pause * 1000:.2f}'} ms"
        )
    cost = f.get("step_cost") or {}
    if cost.get("mixed_steps") and cost.get("plain_step_s") is not None:
        per_work = cost.get("cost_per_work_s")
        reach = "; out of reach: token cap" if cost.get("out_of_reach") else ""
        prefill += (
            f"; timed chunks (ratio {cost['ratio']:g}) over {cost['mixed_steps']} mixed steps: "
            f"plain step {cost['plain_step_s'] * 1e3:.2f} ms, "
            f"+{'-' if per_work is None else f'{per_work * 1e6:.2f}'} us per token's worth "
            f"of work, largest chunk {cost.get('largest_chunk')}{padding_text(cost)}{reach}"
        )
    return name, prefill

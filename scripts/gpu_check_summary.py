"""The short table at the end of scripts/gpu-check.sh, from its results folder.

    python scripts/gpu_check_summary.py RESULTS_DIR [--write summary.txt]

Reads steps.tsv (each step's status), rag.json, long-prefill.json, long-prefill-CAP.json
(other chunk caps), rag-hf-cb.json, rag-sweep.json, moe-rag.json and qwen3-rag.json (rag's
prompts on a Qwen3-MoE and on a dense Qwen3) and quant-ROW.json (the quantized rows; all
`kvbatch bench --json`), gemma-window.json (`kvbatch bench gemma-window --json`: window KV on
and off) and prints the steps, the rag tables (seconds, tokens/s, latency,
ratio, fraction of the floor), the quantized rows (seconds, output tokens/s, weight GiB, KV
capacity in tokens)
and the two GPU targets: `rag` in at most 1.5 s on an H200, and in `long-prefill` no decoding
request waiting more than 3 decode steps. Runs with the standard library alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

from kvbatch.bench.kernel_profile import format_kernel_profile
from kvbatch.bench.long_prefill import longest_steps_text, reference_and_prefill_text
from kvbatch.bench.step_profile import format_step_profile
from kvbatch.bench.text_table import format_rows

RAG_TARGET_S = 1.5  # at most 1.5 s on an H200 (8x transformers' static generate)
RAG_GOAL_S = 1.0
GAP_TARGET = 3.0  # decode steps

OTHER_MODEL_STEPS = (
    ("rag-moe", "moe-rag.json"),
    ("rag-qwen3", "qwen3-rag.json"),
    ("rag-gpt-oss", "gpt-oss-rag.json"),
)
"""rag's prompts on another model (a Qwen3-MoE; a dense Qwen3 at 8B's shapes) against
transformers: a table each, and no verdict (the 1.5 s target is the Llama rag's)."""


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def step_rows(path: Path) -> list[dict[str, str]]:
    """steps.tsv's rows (step, status, rc, seconds, limit, last line); none if it is missing."""
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


def steps_lines(rows: list[dict[str, str]]) -> list[str]:
    if not rows:
        return ["(no steps.tsv)"]
    table = [["step", "status", "seconds", "limit", "last line"]]
    for r in rows:
        table.append(
            [r["step"], r["status"], r["seconds"], r["limit"], (r["last line"] or "")[:90]]
        )
    return format_rows(table)


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rag_lines(data: dict[str, Any] | None, *, verdict: bool = True) -> list[str]:
    """A rag run's table, greedy matches, step and kernel profiles; with `verdict`, the 1.5 s
    target's (the rag step's; the hf-cb step's own kvbatch run is a second reading, not the
    verdict)."""
    if data is None:
        return ["rag: no results (the step failed or timed out; see gpu-check.log)"]
    w, m = data["workload"], data["machine"]
    lines = [f"{w['name']} on {m['device']} ({m['device_name']}), {data['date']}"]
    floor = data.get("floor") or {}
    table = [["engine", "seconds", "tok/s", "TTFT p50", "TPOT p50", "TPOT p99", "ratio"]]
    if floor.get("applies"):
        table[0].append("of floor")
    for e in data["engines"]:
        row = [
            e["engine"],
            f"{e['seconds']:.2f}",
            f"{e['tokens_per_s']:.0f}",
            _ms(e.get("ttft_p50")),
            _ms(e.get("tpot_p50")),
            _ms(e.get("tpot_p99")),
            "-" if e.get("ratio") is None else f"{e['ratio']:.2f}",
        ]
        if floor.get("applies"):
            frac = e.get("floor_fraction")
            row.append("-" if frac is None else f"{frac:.0%}")
        table.append(row)
    lines += format_rows(table)
    lines.append("(TTFT/TPOT in ms; ratio = engine seconds / kvbatch seconds)")
    dtype = (data.get("options") or {}).get("dtype", "float32")
    for g in data.get("greedy_match", []):
        note = ""
        if g["matching"] < g["compared"] and dtype != "float32" and g["engine"].startswith("hf-"):
            note = (
                f" ({dtype} on both: a near tie can flip a token and all after it; the float32 "
                "greedy step is the exact check)"
            )
        lines.append(
            f"greedy tokens {g['engine']} vs {g['reference']}: "
            f"{g['matching']}/{g['compared']}{note}"
        )
    for e in data["engines"]:  # kvbatch, and kvbatch-sync (async scheduling off) if it ran
        profile = (e.get("extra") or {}).get("step_profile") or {}
        if profile.get("steps"):
            lines.append(format_step_profile(profile, e["engine"]))
        kernels = (e.get("extra") or {}).get("kernel_profile")
        if kernels:  # --kernel-profile: where the device time went
            lines.append(format_kernel_profile(kernels, e["engine"]))
    if verdict:
        kv = next((e for e in data["engines"] if e["engine"] == "kvbatch"), None)
        lines.append(rag_target_line(kv, w["name"], bool(floor.get("applies"))))
    lines += [f"warning: {w}" for w in data.get("warnings", [])]
    return lines


def rag_target_line(kv: dict[str, Any] | None, workload: str, on_h200: bool) -> str:
    """The verdict on kvbatch's rag seconds (only the full rag on an H200 counts)."""
    head = f"target (<= {RAG_TARGET_S} s on an H200)"
    if kv is None:
        return f"{head}: kvbatch did not run"
    if workload != "rag" or not on_h200:
        return f"{head}: n/a here (not the full rag on an H200)"
    verdict = "MET" if kv["seconds"] <= RAG_TARGET_S else "MISSED"
    goal = "; goal 1.0 s met" if kv["seconds"] <= RAG_GOAL_S else ""
    return f"{head}: {verdict} ({kv['seconds']:.2f} s{goal})"


def long_prefill_lines(data: dict[str, Any] | None) -> list[str]:
    """A long-prefill run's gap against a plain decode step, and the 3-step target's verdict
    (older results, without the plain decode step: see reference_and_prefill_text)."""
    if data is None:
        return ["long-prefill: no results (the step failed or timed out; see gpu-check.log)"]
    kv = next((e for e in data["engines"] if e["engine"] == "kvbatch"), None)
    f = (kv or {}).get("long_prefill") or {}
    ratio = f.get("gap_ratio")
    options = data.get("options") or {}
    threshold = options.get("long_prefill_token_threshold")
    settings = f"long_prefill_token_threshold {'default' if threshold is None else threshold}"
    if "long_prefill_step_ratio" in options:  # results from before it existed lack it
        step_ratio = options["long_prefill_step_ratio"]
        settings += (
            f", long_prefill_step_ratio {'default' if step_ratio is None else f'{step_ratio:g}'}"
        )
    if options.get("cuda_graph_max_chunk") == 0:
        settings += ", mixed steps eager (cuda_graph_max_chunk 0)"
    if options.get("freeze_gc") is False:
        settings += ", startup heap not frozen (--no-freeze-gc)"
    reference, prefill = reference_and_prefill_text(f)
    lines = [
        f"{data['workload']['name']} ({settings}): "
        f"longest token gap {_ms(f.get('max_token_gap_s'))} ms, "
        f"{reference} {_ms(f.get('median_decode_step_s'))} ms, "
        f"ratio {'-' if ratio is None else f'{ratio:.1f}'} decode steps{prefill}; the long "
        f"prompt's first token after {_ms(f.get('long_prompt_ttft_s'))} ms"
    ]
    if longest := longest_steps_text(f):
        lines.append(f"longest steps: {longest}")
    extra = (kv or {}).get("extra") or {}
    profile = extra.get("step_profile") or {}
    if profile.get("steps"):  # whether the steps with a chunk replayed graphs
        before = extra.get("graphs_captured_after_warmup")
        lines.append(
            f"CUDA graphs: {profile['graph_steps']} of {profile['steps']} steps replayed one, "
            f"{profile.get('mixed_graph_steps', 0)} of them with a prompt chunk, "
            f"{profile.get('graph_captures', 0)} captured in the run, "
            f"{profile.get('graph_first_launches', 0)} launched for the first time (last run)"
            + (f"; {before} more captured after the warm-up" if before else "")
            + _launches_text(extra.get("graph_launches_after_warmup"))
        )
    if ratio is None:
        lines.append(f"target (<= {GAP_TARGET:g} decode steps): not measured")
    else:
        verdict = "MET" if ratio <= GAP_TARGET else "MISSED"
        tiny = "" if data["workload"]["name"] == "long-prefill" else " (tiny run: indicative only)"
        lines.append(f"target (<= {GAP_TARGET:g} decode steps): {verdict}{tiny}")
    return lines


def _launches_text(t: dict[str, Any] | None) -> str:
    """What launching the graphs captured after the warm-up cost (engine/exec/cuda_graphs.py
    FirstLaunches): the first launch uploads a graph, so first against again is that upload."""
    if not t:
        return ""
    return (
        f" and launched once: {t['first_device_ms']:.1f} ms on the device "
        f"({t['first_host_ms']:.1f} on the host) the first time, "
        f"{t['again_device_ms']:.1f} ({t['again_host_ms']:.1f}) again"
    )


def sweep_lines(data: dict[str, Any] | None) -> list[str]:
    """The rag sweep's cells (if the optional step ran): which defaults would serve rag best."""
    if data is None:
        return []
    table = [["seqs", "tokens/step", "seconds", "tok/s", "TPOT p99", "kv blocks", "note"]]
    for c in data["cells"]:
        if c.get("error"):
            table.append([str(c["max_num_seqs"]), str(c["max_num_batched_tokens"])] + ["-"] * 4)
            table[-1].append(c["error"][:50])
            continue
        table.append(
            [
                str(c["max_num_seqs"]),
                str(c["max_num_batched_tokens"]),
                f"{c['seconds']:.2f}",
                f"{c['tokens_per_s']:.0f}",
                _ms(c.get("tpot_p99")),
                str(c.get("num_kv_blocks") or "-"),
                f"{c['num_preemptions']} preemptions" if c.get("num_preemptions") else "",
            ]
        )
    ok = [c for c in data["cells"] if not c.get("error") and c.get("seconds")]
    lines = [f"{data['workload']['name']} sweep (kvbatch alone, one engine per cell):"]
    lines += format_rows(table)
    if ok:
        best = min(ok, key=lambda c: c["seconds"])
        lines.append(
            f"fastest: max_num_seqs {best['max_num_seqs']}, max_num_batched_tokens "
            f"{best['max_num_batched_tokens']}: {best['seconds']:.2f} s"
        )
    return lines


def gemma_window_lines(data: dict[str, Any] | None) -> list[str]:
    """rag-gemma's table: `kvbatch bench gemma-window --json`, window KV off and on under one
    KV budget, their ratios and whether their greedy tokens agree."""
    if data is None:
        return ["gemma-window: no results (the step failed or timed out; see gpu-check.log)"]
    m, model, job = data["machine"], data["model"], data["job"]
    lines = [
        f"gemma-window: {model['name']} (window {model['window']}) on {m['device']} "
        f"({m['device_name']}), {data['date']}: {job['num_prompts']} prompts of "
        f"{job['prompt_tokens']} tokens, {job['output_tokens']} out, KV budget "
        f"{job['kv_cache_bytes'] / 2**20:,.0f} MiB"
    ]
    table = [["window KV", "KV blocks", "most seqs", "mean seqs", "preempted", "seconds", "tok/s"]]
    for mode in ("off", "on"):
        r = data["modes"][mode]
        table.append(
            [
                mode,
                str(r["num_kv_blocks"]),
                str(r["max_running"]),
                f"{r['mean_running']:.1f}",
                str(r["num_preemptions"]),
                f"{r['seconds']:.2f}",
                f"{r['tokens_per_s']:.1f}",
            ]
        )
    lines += format_rows(table)
    x = {k: "-" if v is None else f"{v:.2f}x" for k, v in data["ratios"].items()}
    tokens = "identical" if data["greedy_identical"] else "DIFFER"
    lines.append(
        f"on/off: sequences at once {x['max_running']} (most), {x['mean_running']} (mean); "
        f"throughput {x['tokens_per_s']}; greedy tokens {tokens}"
    )
    return lines


def quant_lines(folder: Path) -> list[str]:
    """One row per quant-ROW.json: the format, speed and memory of kvbatch on that workload,
    in the order the rows ran (steps.tsv), with each workload's float row as the 1.00x."""
    rows = []
    for path in sorted(folder.glob("quant-*.json"), key=lambda p: p.stat().st_mtime):
        data = _load(path)
        kv = None if data is None else next(iter(data.get("engines") or []), None)
        if kv is None:
            rows.append((path.stem, None, None, None))
            continue
        rows.append((path.stem, data["workload"]["name"], data["options"], kv))
    if not rows:
        return []
    floats = [(w, o, kv) for _, w, o, kv in rows if kv is not None]
    # the rag and rag-moe steps' kvbatch rows: the float baselines of those workloads' rows
    for step in ("rag.json", "moe-rag.json"):
        data = _load(folder / step)
        step_kv = next(
            (e for e in (data or {}).get("engines", []) if e["engine"] == "kvbatch"), None
        )
        if step_kv is not None:
            floats.append((data["workload"]["name"], data["options"], step_kv))
    base = {(w, o["max_num_seqs"]): kv["seconds"] for w, o, kv in floats if not _quantized(o, kv)}
    table = [["row", "workload", "seqs", "weights", "KV", "seconds", "out tok/s", "x float"]]
    table[0] += ["weights GiB", "KV tokens"]
    for name, w, o, kv in rows:
        if kv is None:
            table.append([name.removeprefix("quant-"), "no results"] + ["-"] * 8)
            continue
        stats = kv.get("extra", {}).get("stats", {})
        float_s = base.get((w, o["max_num_seqs"]))
        speedup = "-" if float_s is None else f"{float_s / kv['seconds']:.2f}"
        tokens = stats.get("num_kv_blocks", 0) * stats.get("block_size", 0)
        table.append(
            [
                name.removeprefix("quant-"),
                w,
                str(o["max_num_seqs"]),
                stats.get("quantization") or o["dtype"],
                str(stats.get("kv_cache_dtype", "-")),
                f"{kv['seconds']:.2f}",
                f"{kv['tokens_per_s']:.0f}",
                speedup,
                f"{stats.get('weight_bytes', 0) / 2**30:.3f}",
                str(tokens),
            ]
        )
    return ["quantized rows (kvbatch alone; x float: the float row's seconds / this row's):"] + (
        format_rows(table)
    )


def _quantized(options: dict[str, Any], kv: dict[str, Any]) -> bool:
    stats = kv.get("extra", {}).get("stats", {})
    return bool(stats.get("quantization") or options.get("kv_cache_dtype") == "fp8")


def summary(folder: Path) -> str:
    lines = [f"GPU check summary: {folder}", ""]
    rows = step_rows(folder / "steps.tsv")
    lines += steps_lines(rows)
    skipped = {r["step"] for r in rows if r["status"] == "skipped"}
    for name, results, describe in (
        ("rag", folder / "rag.json", rag_lines),
        ("long-prefill", folder / "long-prefill.json", long_prefill_lines),
    ):
        lines.append("")
        lines += [f"{name}: skipped"] if name in skipped else describe(_load(results))
    for path in sorted(folder.glob("long-prefill-*.json"), key=_cap):  # other chunk caps
        lines += long_prefill_lines(_load(path))
    if "rag-hf-cb" in {r["step"] for r in rows} - skipped:  # transformers' continuous batching
        lines += ["", "rag with hf-cb (its own step):"]
        lines += rag_lines(_load(folder / "rag-hf-cb.json"), verdict=False)
    sweep = sweep_lines(_load(folder / "rag-sweep.json"))
    if sweep:
        lines += [""] + sweep
    for step, results in OTHER_MODEL_STEPS:
        if step in {r["step"] for r in rows} - skipped:
            lines += ["", f"{step} (its own step):"]
            lines += rag_lines(_load(folder / results), verdict=False)
    if "rag-gemma" in {r["step"] for r in rows} - skipped:
        lines += [""] + gemma_window_lines(_load(folder / "gemma-window.json"))
    quant = quant_lines(folder)
    if quant:
        lines += [""] + quant
    return "\n".join(lines)


def _cap(path: Path) -> tuple[int, str]:
    """long-prefill-512.json before long-prefill-256.json: caps from high to low."""
    cap = path.stem.rsplit("-", 1)[-1]
    return (-int(cap) if cap.isdigit() else 0, path.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Summarise a scripts/gpu-check.sh results folder.")
    p.add_argument("folder", type=Path)
    p.add_argument("--write", type=Path, help="also write the summary to this file")
    args = p.parse_args(argv)
    text = summary(args.folder)
    print(text)
    if args.write is not None:
        args.write.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

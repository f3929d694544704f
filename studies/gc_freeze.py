"""`gc-freeze`: what the cycle collector costs an engine's run, with and without the freeze.

    python -m studies gc-freeze [--decoders 128] [--output-len 400] [--kv-blocks 250000] [--json F]

A full collector pass examines every tracked object that is not frozen: right after an
engine starts that is its whole startup heap (engine/core/startup_heap.py). This runs the same
decode job on the tiny random model twice in one process, the startup heap first left in
the passes (`freeze_gc=False`, as before the freeze) and then frozen, and reports for each:
tracked objects after the start, the run's passes per generation with the longest pause,
and one forced full pass after the run (what a pass costs at that heap size). `--kv-blocks`
also times a full pass over a KV block manager of that many blocks alone (one `Block` each:
the rag model on an H200 has 250k). On a GPU whose decode step is 1-2 ms a pause of tens of
milliseconds is a token gap of tens of steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

from kvbatch.bench.gc_pauses import GCPauses


def full_pass_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def kv_blocks_pass_ms(num_blocks: int) -> float:
    """A full pass over a KVCacheManager of `num_blocks` blocks alone (ms): the rest of the
    heap is frozen meanwhile, so the pass examines the manager's objects only."""
    from kvbatch.engine.kv.kv_cache import KVCacheManager

    gc.collect()
    gc.freeze()
    try:
        kv = KVCacheManager(num_blocks, 16, True)
        ms = full_pass_ms()
        del kv
        return ms
    finally:
        gc.unfreeze()


def run_once(freeze: bool, decoders: int, output_len: int) -> dict[str, Any]:
    from kvbatch.bench.models import TINY_LLAMA, random_model_dir
    from kvbatch.engine import LLM, SamplingParams
    from kvbatch.engine.core.startup_heap import thaw_startup_heap

    llm = LLM(str(random_model_dir(TINY_LLAMA)), max_num_seqs=decoders, freeze_gc=freeze)
    try:
        tracked = len(gc.get_objects())  # frozen objects are in no generation
        prompts = [[5 + i % 50] * 64 for i in range(decoders)]
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
        with GCPauses() as pauses:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        # timed after the run: a pass before it would reset the collector's counts, and the
        # first pass a fresh engine's run meets is the one its startup leaves pending
        after_run = full_pass_ms()
        return {
            "freeze_gc": freeze,
            "frozen_objects": llm.engine.frozen_gc_objects,
            "tracked_objects": tracked,
            "full_pass_after_run_ms": after_run,
            "steps": llm.engine._num_steps,
            "seconds": seconds,
            "gc": pauses.summary(),
        }
    finally:
        del llm
        thaw_startup_heap()  # the next run (or the caller) starts from a thawed heap


def measure(decoders: int = 128, output_len: int = 400, kv_blocks: int = 0) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    return {
        "decoders": decoders,
        "output_len": output_len,
        "runs": [run_once(freeze, decoders, output_len) for freeze in (False, True)],
        "kv_blocks": kv_blocks,
        "kv_blocks_full_pass_ms": kv_blocks_pass_ms(kv_blocks) if kv_blocks else None,
        "python": sys.version.split()[0],
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def format_result(r: dict[str, Any]) -> str:
    lines = [
        f"gc-freeze: {r['decoders']} decoders x {r['output_len']} tokens on the tiny model, "
        f"Python {r['python']}",
        "",
        "| startup heap | tracked objects | full pass after the run (ms) | steps "
        "| passes gen 0/1/2 | longest full pass (ms) | longest pause (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in r["runs"]:
        g = run["gc"]
        lines.append(
            f"| {'frozen' if run['freeze_gc'] else 'in the passes'} | {run['tracked_objects']:,} "
            f"| {run['full_pass_after_run_ms']:.1f} | {run['steps']} "
            f"| {'/'.join(map(str, g['collections']))} | {_ms(g['longest_full_pass_s'])} "
            f"| {_ms(g['longest_pause_s'])} |"
        )
    if r["kv_blocks_full_pass_ms"] is not None:
        lines.append(
            f"\na full pass over {r['kv_blocks']:,} KV blocks alone: "
            f"{r['kv_blocks_full_pass_ms']:.1f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies gc-freeze", description=__doc__)
    ap.add_argument("--decoders", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=400)
    ap.add_argument("--kv-blocks", type=int, default=0, help="also time N KV blocks alone")
    ap.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = ap.parse_args(argv)
    if args.decoders < 1 or args.output_len < 1 or args.kv_blocks < 0:
        ap.error("--decoders and --output-len must be >= 1, --kv-blocks >= 0")
    result = measure(args.decoders, args.output_len, args.kv_blocks)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

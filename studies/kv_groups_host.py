"""`kv-groups-host`: what window KV groups cost the host per decode step, beside one table.

    python -m studies kv-groups-host [--seqs 200] [--prompt 2000] [--steps 48] [--json F]

The scheduler asks the KV manager for every running sequence's slots each step, in Python.
With window groups (engine/kv/hybrid.py) that is one call into group 0 and one into each
window group: Gemma 3 1B's layers (4 global, 22 local with window 512) make 7 groups. This
admits `--seqs` sequences of `--prompt` random tokens into a roomy pool, then times
`--steps` decode steps (one token each) through a single-table KVCacheManager and through
the hybrid manager of that layout, no model: only the bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from kvbatch.engine.kv.hybrid import HybridKVCacheManager
from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.kv.layout import plan_layout

GEMMA3_1B_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]


def decode_ms_per_step(kv, num_seqs: int, prompt: int, steps: int, seed: int = 0) -> float:
    """Host milliseconds of one decode step's allocations for num_seqs sequences."""
    rng = random.Random(seed)
    seqs = {}
    for i in range(num_seqs):
        tokens = [rng.randrange(32000) for _ in range(prompt)]
        if not kv.allocate_slots(i, tokens, prompt, kv.get_computed_blocks(tokens)):
            raise ValueError("the pool is too small for the sequences asked for")
        tokens.append(1)
        seqs[i] = tokens
    start = time.perf_counter()
    for _ in range(steps):
        for i, tokens in seqs.items():
            kv.allocate_slots(i, tokens, 1)
            tokens.append(2)
    return (time.perf_counter() - start) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m studies kv-groups-host", description=__doc__)
    p.add_argument("--seqs", type=int, default=200)
    p.add_argument("--prompt", type=int, default=2000)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    layout = plan_layout(GEMMA3_1B_WINDOWS)
    per_seq = layout.blocks_per_seq(args.prompt + args.steps + 1, args.block_size, args.prompt)
    blocks = args.seqs * per_seq + 1
    one = decode_ms_per_step(
        KVCacheManager(blocks, args.block_size), args.seqs, args.prompt, args.steps
    )
    hybrid = decode_ms_per_step(
        HybridKVCacheManager(layout, blocks, args.block_size), args.seqs, args.prompt, args.steps
    )
    print(
        f"kv-groups-host: {args.seqs} sequences of {args.prompt} tokens, {args.steps} decode "
        f"steps, Gemma 3 1B's layout ({len(layout.groups)} groups, {layout.num_slots} slots)"
    )
    print(f"one table     {one:8.3f} ms a step")
    print(f"window groups {hybrid:8.3f} ms a step ({hybrid / one:.1f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"one_table_ms": one, "window_groups_ms": hybrid, **vars(args)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())

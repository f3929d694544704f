"""`chunk-padding`: timed chunks against the chunk buckets of mixed-step CUDA graphs, simulated.

    kvbatch bench chunk-padding [--prompt-len 32768] [--plain-ms 1.4] [--json F]

On CUDA a step with decodes and one prompt chunk replays the graph of the chunk's bucket
(engine/cuda_graphs.py), so its matmuls cost the bucket's rows, not the chunk's tokens, while
the engine's step cost loop (engine/step_cost.py) sizes the next chunk from the times of the
last ones. Whether the two fit together decides the long-prefill target, and no CPU can time a
graph, so this simulates the steps: a mixed step costs a fixed part, a part per computed row
and a part per attention pair (at half the matmuls' rate per FLOP, as measured on the H200),
and the real StepCostModel sizes every chunk of a 32k prompt from those times. Per cost case,
bucket set (doubling, the engine's ~1.5x steps) and what the loop is charged for (the chunk's
tokens, as before it knew the buckets, or the rows its graph computed): steps to prefill, the
longest and the mean step over the budget, and the longest token gap that implies in plain
decode steps (target <= 3).
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections.abc import Sequence
from typing import Any

from kvbatch.bench.text_table import format_rows
from kvbatch.engine.exec.cuda_graphs import CHUNK_BUCKETS
from kvbatch.engine.sched.step_cost import StepCostModel, StepShape, chunk_pairs

DOUBLING = (16, 32, 64, 128, 256, 512)  # the chunk buckets before the 1.5x steps
BREAK_EVEN = 14848  # Llama-3.2-1B's (the rag model's) break-even context
RATIO = 2.5  # long_prefill_step_ratio's CUDA default
TOKEN_CAP = 2048  # long_prefill_token_threshold's default: the cap before a step is timed
DECODES = 64
# (fixed s, s per row) of a mixed step: 4 us a row is a 1B model's 2.4 GFLOP a token at ~600
# TFLOP/s; at 2 us (a faster GPU, a smaller model) chunks reach the last bucket
CASES = [(0.0, 2e-6), (0.0, 4e-6), (0.0, 8e-6), (5e-4, 4e-6), (5e-4, 8e-6), (1e-3, 4e-6)]
EAGER_S = 1e-3  # an eager mixed step's launches over a graph replay's (~200 at ~5 us)


def padded(n: int, buckets: Sequence[int]) -> int:
    """The rows a chunk of n tokens computes: its bucket, or n past the last one."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def simulate_prefill(
    model: StepCostModel,
    plain_s: float,
    per_row_s: float,
    fixed_s: float,
    buckets: Sequence[int],
    charge_rows: bool,
    prompt_len: int = 32768,
    break_even: int = BREAK_EVEN,
    eager_s: float = 0.0,
) -> list[tuple[int, int, float]]:
    """A long prompt prefilled beside decodes, each chunk sized by `model` from the simulated
    times: (chunk tokens, context before it, its step's time over a plain step) per step.
    A chunk's attention costs 2 x per_row_s per `break_even` query-key pairs (attention at
    half the matmuls' rate); a chunk past the last bucket runs eagerly and costs `eager_s`
    more (the host's launches); `charge_rows`: the step reports its padded rows."""
    steps, context = [], 0
    while context < prompt_len:
        cap = model.chunk_cap(context)
        n = min(TOKEN_CAP if cap is None else cap, prompt_len - context)
        rows = padded(n, buckets)
        pairs = chunk_pairs(n, context)
        extra = fixed_s + per_row_s * rows + 2 * per_row_s * pairs / break_even
        if n > buckets[-1]:
            extra += eager_s
        shape = StepShape(DECODES, n, pairs, n, rows if charge_rows else 0)
        model.observe(shape, plain_s + extra)
        steps.append((n, context, extra))
        context += n
    return steps


def timed_model(plain_s: float, buckets: Sequence[int] | None) -> StepCostModel:
    """A cost model that has timed a few plain steps; sizing against `buckets` when given."""
    model = StepCostModel(RATIO, BREAK_EVEN, (lambda: buckets) if buckets else None)
    for _ in range(5):
        model.observe(StepShape(DECODES, 0, 0), plain_s)
    return model


def run_case(
    plain_s: float, per_row_s: float, fixed_s: float, eager_s: float, buckets: Sequence[int],
    charge_rows: bool, prompt_len: int,
) -> dict[str, Any]:  # fmt: skip
    model = timed_model(plain_s, buckets if charge_rows else None)
    steps = simulate_prefill(
        model, plain_s, per_row_s, fixed_s, buckets, charge_rows, prompt_len, eager_s=eager_s
    )
    budget = (RATIO - 1) * plain_s
    settled = [extra / budget for _, _, extra in steps[8:-1]] or [0.0]  # after the ramp
    return {
        "fixed_ms": fixed_s * 1e3,
        "per_row_us": per_row_s * 1e6,
        "eager_ms": eager_s * 1e3,
        "eager_steps": sum(1 for n, _, _ in steps if n > buckets[-1]),
        "buckets": "doubling" if tuple(buckets) == DOUBLING else "1.5x",
        "charged": "rows" if charge_rows else "tokens",
        "steps": len(steps),
        "longest_over_budget": max(settled),
        "mean_over_budget": sum(settled) / len(settled),
        "longest_gap_plain_steps": 1 + (RATIO - 1) * max(settled),
    }


def measure(prompt_len: int = 32768, plain_ms: float = 1.4) -> list[dict[str, Any]]:
    plain_s = plain_ms / 1e3
    rows = []
    for fixed_s, per_row_s in CASES:
        for buckets, charge_rows in (
            (DOUBLING, False),
            (DOUBLING, True),
            (CHUNK_BUCKETS, False),
            (CHUNK_BUCKETS, True),
        ):
            rows.append(
                run_case(plain_s, per_row_s, fixed_s, EAGER_S, buckets, charge_rows, prompt_len)
            )
    return rows


def format_result(rows: list[dict[str, Any]], prompt_len: int, plain_ms: float) -> str:
    head = (
        f"chunk-padding: a {prompt_len}-token prompt beside {DECODES} decoders, simulated "
        f"(plain step {plain_ms:g} ms, ratio {RATIO:g}: budget {(RATIO - 1) * plain_ms:.2f} ms "
        f"a step; an eager step past the last bucket {EAGER_S * 1e3:g} ms more); steps after "
        "the first 8"
    )
    header = ["fixed ms", "us per row", "buckets", "charged for", "steps", "eager steps"]
    header += ["longest / budget", "mean / budget", "longest gap (plain steps)"]
    cells = [
        [
            f"{r['fixed_ms']:.1f}",
            f"{r['per_row_us']:.0f}",
            r["buckets"],
            r["charged"],
            str(r["steps"]),
            str(r["eager_steps"]),
            f"{r['longest_over_budget']:.2f}",
            f"{r['mean_over_budget']:.2f}",
            f"{r['longest_gap_plain_steps']:.2f}",
        ]
        for r in rows
    ]
    table = "\n".join(format_rows([header, *cells]))
    return f"{head}\n\n{table}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbatch bench chunk-padding", description=__doc__)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--plain-ms", type=float, default=1.4, help="a plain decode step (H200: 1.4)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    if args.prompt_len < 1 or args.plain_ms <= 0:
        ap.error("--prompt-len must be >= 1 and --plain-ms > 0")
    rows = measure(args.prompt_len, args.plain_ms)
    print(format_result(rows, args.prompt_len, args.plain_ms))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0

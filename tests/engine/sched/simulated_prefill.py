"""A long prompt prefilled beside decodes on a simulated GPU whose step times are known, for
the step cost loop's tests.

On CUDA a step with decodes and one prompt chunk replays the graph of the chunk's bucket
(kvbatch.engine.exec.cuda_graphs), so its matmuls cost the bucket's rows, not the chunk's
tokens, while the step cost loop (kvbatch.engine.sched.step_cost) sizes the next chunk from
the times of the last ones. No CPU can time a graph, so the steps are simulated: a mixed step
costs a fixed part, a part per computed row and a part per attention pair (attention at half
the matmuls' rate per FLOP), and the real StepCostModel sizes every chunk from those times.
docs/archive/BENCHMARKS-history.md ("chunks sized against the graphs' buckets") has the
table this simulation gave over more cost cases.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from kvbatch.engine.sched.step_cost import StepCostModel, StepShape, chunk_pairs

DOUBLING = (16, 32, 64, 128, 256, 512)  # chunk buckets that double, against the engine's ~1.5x
BREAK_EVEN = 14848  # Llama-3.2-1B's break-even context: attention pairs that cost one token
TOKEN_CAP = 2048  # long_prefill_token_threshold's default: the cap before a step is timed
DECODES = 64


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

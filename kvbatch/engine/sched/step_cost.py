"""How long a step takes, learned from the steps the engine has run: sizes long prompts' chunks.

The long-prefill target is about time, not tokens: while a 32k prompt is prefilled, no
decoding request should wait more than a few plain decode steps for its next token. How many
prompt tokens fit in that time depends on the GPU, the model and how deep into the prompt the
chunk is (its attention reads every earlier token), and a fixed token cap is right for one
of them at most (a cap sized for a short context is far too long deep into 32k). So the engine
times its steps and sizes each chunk so that a step with decodes and the chunk takes
`ratio` plain decode steps:

    budget = (ratio - 1) x plain step       (the median of the recent plain decode steps)
    work(n, context) = n + pairs / c        (pairs = n x context + n (n + 1) / 2: the chunk's
                                             query-key pairs; c = the model's break-even
                                             context, attention FLOPs against matmul FLOPs)
    cost = moving average over mixed steps of (mixed step - plain step) / work
    next chunk: the largest n with cost x work(n, context) <= budget

Why a feedback loop and not a fitted cost model: the steps it learns from are the ones it sized,
all built to cost the same, so a fit of separate costs (a mixed step's fixed cost, per token,
per attention pair) cannot tell them apart: the fitted fixed cost wanders between runs, and a
chunk sized from a bad fit overshoots the budget many times over. The loop needs none of them:
if a mixed step costs e + s x work, the average settles where e + s x work = budget, for any e
under the budget, and it follows the context as the prompt goes on (work's FLOP shape carries
the chunk from one context to the next; an attention slower than its FLOPs only moves the
average, slowly).

Padded chunks: with CUDA graphs, a step with one prompt chunk replays the graph of the next
chunk bucket up (engine/exec/cuda_graphs.py: 16, 32, 48, ..., 512 tokens), so a 300-token
chunk costs the matmuls of 384 (the attention skips the padding rows). Counted as 300 tokens, the
loop would read that as a dearer token and swing between buckets, every swing up a step over
the budget (tests/engine/sched/simulated_prefill.py simulates it). So the work counts
the rows the step computed (`StepShape.prefill_rows`), and a chunk is sized against its
bucket: the largest n whose bucket's rows plus its own attention fit, which fills buckets
whole when they fit, and never past the last one (an eager step: `chunk_buckets`).

Guards: the first chunk is a probe (PROBE_TOKENS); no chunk is more than GROWTH times the
largest measured; none is under MIN_CHUNK. If steps with floor-sized chunks keep costing more
than the budget, no chunk size meets the ratio (the fixed cost of a mixed step is over it):
a warning says so and long prompts go back to the token cap, rather than crawl. With CUDA
graphs the chunks still stay within the last bucket: a larger one runs eagerly, far dearer
than a replay (where even a floor-sized chunk is over budget, the token cap's eager chunks
would make a decoder wait for a whole long chunk).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

PROBE_TOKENS = 64  # the first chunk, before any mixed step has been timed
GROWTH = 2  # no chunk is more than this many times the largest one measured
MIN_CHUNK = 16  # never cut a prompt finer than this: each step also pays for the decodes
PLAIN_WINDOW = 16  # a plain step is the median of the last this many (one slow one, e.g. a
# first step at a new shape, must not move the budget)
COST_SMOOTHING = 0.5  # weight of the newest mixed step in the cost average
OUT_OF_REACH_STEPS = 3  # floor-sized chunks over the budget in a row: the ratio is out of reach


@dataclass(frozen=True)
class StepShape:
    """What a step computes, as the cost model counts it."""

    num_decodes: int  # rows of running sequences past their prompt
    prefill_tokens: int  # prompt tokens (chunks of sequences still in their prompt)
    prefill_pairs: int  # query-key pairs of those chunks' attention
    longest_chunk: int = 0  # the largest prompt chunk in the step
    prefill_rows: int = 0  # rows the prompt part computed when a graph padded its chunk to a
    # bucket (0: prefill_tokens, no padding)

    @property
    def computed_prefill_rows(self) -> int:
        return max(self.prefill_rows, self.prefill_tokens)

    @property
    def is_plain(self) -> bool:
        return self.num_decodes > 0 and self.prefill_tokens == 0

    @property
    def is_mixed(self) -> bool:
        return self.num_decodes > 0 and self.prefill_tokens > 0


def chunk_pairs(num_tokens: int, context: int) -> int:
    """Query-key pairs of a causal chunk of `num_tokens` after `context` cached tokens."""
    return num_tokens * context + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    """Plain decode steps' time (a running median) and a mixed step's extra time per unit of
    work (a moving average): the chunk that fits the budget."""

    def __init__(
        self,
        ratio: float,
        break_even_context: int,
        chunk_buckets: Callable[[], Sequence[int]] | None = None,
    ) -> None:
        """`chunk_buckets`: the sizes a step's one prompt chunk is padded up to (a CUDA graph
        per size, ascending; timed chunks stay within the last), asked afresh each time since
        a failed capture empties them; None or empty: chunks are not padded."""
        if ratio <= 1:
            raise ValueError(f"the step ratio must be > 1 (a plain step is 1), got {ratio}")
        self.ratio = ratio
        self.break_even = break_even_context  # 0: attention not counted
        self.chunk_buckets = chunk_buckets
        self.plain_seconds: float | None = None  # the median of `_plain`
        self._plain: deque[float] = deque(maxlen=PLAIN_WINDOW)
        self.cost_per_work: float | None = None  # seconds per unit of work, mixed steps
        self.largest_measured = 0  # the longest chunk in a timed mixed step
        self.num_mixed = 0
        self.mixed_tokens = self.mixed_rows = 0  # prompt tokens of timed mixed steps, and the
        # rows computed for them (more when graphs padded the chunks)
        self.out_of_reach = False
        self._floor_over_budget = 0

    def _buckets(self) -> Sequence[int]:
        return self.chunk_buckets() if self.chunk_buckets is not None else ()

    def work(self, num_tokens: int, pairs: int) -> float:
        """A chunk's tokens plus its attention in tokens' worth of FLOPs."""
        return num_tokens + (pairs / self.break_even if self.break_even else 0.0)

    @property
    def budget(self) -> float | None:
        """Seconds a step may add to a plain one."""
        return None if self.plain_seconds is None else (self.ratio - 1) * self.plain_seconds

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A finished step's shape and its measured time."""
        if shape.is_plain:
            self._plain.append(seconds)
            self.plain_seconds = statistics.median(self._plain)
            return
        if not shape.is_mixed or self.plain_seconds is None:
            return
        extra = seconds - self.plain_seconds
        work = self.work(shape.computed_prefill_rows, shape.prefill_pairs)
        per_work = max(extra, 0.0) / work
        old = self.cost_per_work
        self.cost_per_work = per_work if old is None else old + COST_SMOOTHING * (per_work - old)
        self.num_mixed += 1
        self.mixed_tokens += shape.prefill_tokens
        self.mixed_rows += shape.computed_prefill_rows
        self.largest_measured = max(self.largest_measured, shape.longest_chunk)
        if shape.longest_chunk <= MIN_CHUNK:
            over = extra > self.budget
            self._floor_over_budget = self._floor_over_budget + 1 if over else 0
            if self._floor_over_budget >= OUT_OF_REACH_STEPS and not self.out_of_reach:
                self.out_of_reach = True
                buckets = self._buckets()
                log.warning(
                    "a step with a %d-token prompt chunk costs %.2f ms more than a plain decode "
                    "step (%.2f ms): no chunk size keeps it within long_prefill_step_ratio=%g, "
                    "so long prompts keep the token cap%s",
                    shape.longest_chunk,
                    extra * 1e3,
                    self.plain_seconds * 1e3,
                    self.ratio,
                    f" (at most {buckets[-1]} tokens: the last CUDA-graph chunk)"
                    if buckets
                    else "",
                )

    def describe(self) -> dict[str, float | int | bool | None]:
        """What the model has learned, for reports."""
        return {
            "plain_step_s": self.plain_seconds,
            "mixed_steps": self.num_mixed,
            "mixed_tokens": self.mixed_tokens,
            "mixed_rows": self.mixed_rows,
            "cost_per_work_s": self.cost_per_work,
            "break_even_context": self.break_even,
            "ratio": self.ratio,
            "largest_chunk": self.largest_measured,
            "out_of_reach": self.out_of_reach,
        }

    def chunk_cap(self, context: int) -> int | None:
        """The most prompt tokens after `context` cached ones that keep a step with decodes
        within `ratio` plain steps; None when the model cannot say (no plain step timed yet)
        or the ratio is out of reach: the caller keeps its token cap. Out of reach with chunk
        buckets, the last bucket (the token cap applies below it: no eager step)."""
        if self.plain_seconds is None:
            return None
        buckets = self._buckets()
        if self.out_of_reach:
            return buckets[-1] if buckets else None
        if self.cost_per_work is None:
            return PROBE_TOKENS
        most = GROWTH * max(self.largest_measured, PROBE_TOKENS)
        if self.cost_per_work <= 0:
            return most
        target = self.budget / self.cost_per_work  # units of work the budget buys
        n = self._fill_buckets(target, context, buckets)
        return max(MIN_CHUNK, int(min(n, most)))

    def _tokens_within(self, target: float, context: int) -> float:
        """The largest n (real) with n + (n context + n (n + 1) / 2) / c <= target."""
        if not self.break_even:
            return target
        linear = 1 + (context + 0.5) / self.break_even
        quadratic = 0.5 / self.break_even
        return (math.sqrt(linear * linear + 4 * quadratic * target) - linear) / (2 * quadratic)

    def _fill_buckets(self, target: float, context: int, buckets: Sequence[int]) -> float:
        """The largest chunk whose padded rows plus its attention fit `target`: in the bucket
        (lower, size], n + attention(n) becomes size + attention(n), so each bucket allows
        min(size, the n whose attention fits what the size leaves).

        Never past the last bucket: such a chunk runs eagerly and pays the host's launches
        (~200 a step on a 16-layer model) that a graph replay does not, a fixed cost the
        average does not model, so chunks would swing across the boundary with every step
        past it over the budget (tests/engine/sched/simulated_prefill.py shows the swing). A
        user who wants longer chunks raises the last bucket
        (cuda_graph_max_chunk)."""
        n = self._tokens_within(target, context)
        if not buckets:
            return n
        if n >= buckets[-1]:
            return buckets[-1]
        best, lower = 0.0, 0
        for size in buckets:
            left = target - size  # work left for the attention once the rows are paid
            if left >= 0:
                if self.break_even:  # n context + n (n + 1) / 2 <= left x c
                    a = context + 0.5
                    fits = math.sqrt(a * a + 2 * left * self.break_even) - a
                else:
                    fits = size
                fits = min(size, math.floor(fits))
                if fits > lower:
                    best = fits
            lower = size
        return best

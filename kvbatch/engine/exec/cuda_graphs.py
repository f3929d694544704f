"""CUDA graphs for decode steps and for decode steps with one short prompt chunk.

A decode step of B sequences launches a few kernels per layer; at small batches the GPU
waits on those launches. A captured graph replays them all with one call. Graphs have fixed
shapes and fixed addresses, so every input lives in a static buffer sized for the largest
bucket, and a step runs the graph of the smallest bucket that holds it:

    rows 0 .. n-1       the real decodes: token, position, slot, block table, context length
    rows n .. b-1       padding: slot -1 (the KV write skips it), context length 0 (attention
                        writes zeros); their logits are computed and dropped
    rows b .. b+m-1     a mixed step's prompt chunk of m tokens (its first query row is b)
    rows b+m .. b+c-1   padding of the chunk bucket c: slot -1, and the prefill kernel reads
                        the chunk's real length from the device, so its programs skip them

Mixed steps are why this is more than decode graphs: while a long prompt is prefilled in
short chunks beside the decodes (engine/sched/step_cost.py sizes them to a few plain steps), an
eager step pays the host's launches for every layer (~200 on a 16-layer model), which can be
more than the whole budget a chunk has. A graph of (decode bucket, chunk bucket) replays it
with the chunk's length, context and block table in static buffers; its key split count is
fixed for the longest context (`max_prefill_tokens`), and a shorter one leaves some splits
empty. The logits come out only for the rows that sample: a static index buffer of b + 1
rows (the decodes and the chunk's last token) feeds the LM head, not all b + c rows.

Decode graphs (plain, and with shared-prefix groups) are captured at start, largest first,
in one memory pool (each smaller graph reuses the largest one's memory), and launched once
on the all-padding buffers: a graph's first launch also uploads it to the device, which no
step should wait for (`_launch_new`). Mixed
graphs are captured on first use (up to 2 x decode buckets x chunk buckets of them; a run
sees a handful): that step runs eagerly through the static buffers and its graph is captured
after it, for the next. Decode steps with shared-prefix (cascade) groups use a second set of
graphs whose groups live in static buffers too: up to `max_groups` groups, each a range of
decode rows and its shared blocks; unused groups have 0 rows (their programs exit at once):

    group_tables  [max_groups, max_blocks]   each group's shared blocks
    group_ranges  [3, max_groups]            first row, rows (0 = unused), shared tokens

Decode contexts longer than the tables hold (`max_blocks`: kept short because the decode kernel
cuts a context into splits by the table's width, and a short context in a wide table gets too
few) use a third kind, "wide" graphs, whose tables (`wide_tables`) hold the longest context
(`max_wide_blocks`). They too are captured on first use: a long prompt that has finished
prefilling decodes beside the short ones in a replay, not eagerly: an eager step costs far more
than a replay, and such steps were the longest token gaps of `long-prefill` whatever the chunk
size (docs/BENCHMARKS.md). Steps with more prompt chunks, longer chunks, more groups or contexts
longer than `max_wide_blocks` run eagerly. Needs the triton backend, whose kernels skip negative
slots and never read device values on the host.

With sliding-window KV groups (engine/kv/layout.py) each group has its own set of the table
buffers (slots, tables, lengths, the chunk's table); the tokens, positions and logits rows are
shared, and only group 0 has shared-prefix groups.

Without CUDA, `capture=False` runs the same static-buffer path eagerly: the padding and
bucketing logic is then testable on the CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvbatch.engine.attention.metadata import AttentionMetadata, GroupedAttention, PrefillSpan

log = logging.getLogger(__name__)

# Steps of about 1.5x: a chunk pays its bucket's matmuls, and the step cost model sizes chunks
# against the buckets (engine/sched/step_cost.py), so with doubling buckets a chunk that just
# missed one would run in a bucket up to half empty; 1.5x steps waste at most a third. Each
# pair of buckets is one more graph, captured on first use.
CHUNK_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class GraphKey(NamedTuple):
    rows: int  # decode bucket
    cascade: bool  # with shared-prefix groups
    chunk: int = 0  # prompt-chunk bucket (0: a decode step)
    wide: bool = False  # decode tables of max_wide_blocks (a context longer than max_blocks)

    @property
    def on_first_use(self) -> bool:
        """Captured when a step first needs it, not at start."""
        return bool(self.chunk) or self.wide


class FirstLaunches(NamedTuple):
    """What launching new graphs cost, the first time and again (`StepGraphs._launch_new`)."""

    graphs: int
    first_host_ms: float
    first_device_ms: float
    again_host_ms: float
    again_device_ms: float


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (vLLM's spacing): little padding waste."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


def chunk_buckets(max_chunk: int) -> list[int]:
    """CHUNK_BUCKETS up to max_chunk, and max_chunk itself; none for 0 (no mixed graphs)."""
    if max_chunk <= 0:
        return []
    return sorted({*(c for c in CHUNK_BUCKETS if c < max_chunk), max_chunk})


class _TableBuffers:
    """One KV group's static buffers: where a step's K and V go and the tables it reads."""

    def __init__(self, tokens, top, max_blocks, max_wide_blocks, max_groups, prefill_blocks,
                 device) -> None:  # fmt: skip
        i32 = dict(dtype=torch.int32, device=device)
        self.slots = torch.full((tokens,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(top, max_blocks, **i32)
        self.wide_tables = torch.zeros(top, max_wide_blocks, **i32)
        self.seq_lens = torch.zeros(top, **i32)
        self.group_tables = torch.zeros(max_groups, max_blocks, **i32)
        self.group_ranges = torch.zeros(3, max_groups, **i32)
        self.prefill_table = torch.zeros(1, prefill_blocks, **i32)
        self.prefill_ranges = torch.zeros(3, 1, **i32)

    def meta(self, key: GraphKey, max_prefill_tokens: int) -> AttentionMetadata:
        b, cascade, chunk, wide = key
        meta = AttentionMetadata(
            slot_mapping=self.slots[: b + chunk],
            num_decode_tokens=b,
            decode_block_tables=(self.wide_tables if wide else self.tables)[:b],
            decode_seq_lens=self.seq_lens[:b],
            prefills=[],
        )
        if cascade:
            meta.decode_group_tables = self.group_tables
            meta.decode_group_ranges = self.group_ranges
            meta.decode_group_max_rows = b
        if chunk:  # host ints of the span size the launch: the bucket, the longest context
            span = PrefillSpan(b, chunk, max_prefill_tokens, self.prefill_table[0])
            meta.prefills = [span]
            meta.prefill_block_tables = self.prefill_table
            meta.prefill_ranges = self.prefill_ranges
        return meta

    def fill(self, key: GraphKey, meta: AttentionMetadata, m: int) -> None:
        """The step's tables into the buffers (m: its chunk's tokens)."""
        b, cascade, chunk, wide = key
        nd = meta.num_decode_tokens
        _place(self.slots, meta.slot_mapping, nd, b, m)
        self.slots[nd:b].fill_(-1)
        self.slots[b + m : b + chunk].fill_(-1)
        width = meta.decode_block_tables.shape[1]
        (self.wide_tables if wide else self.tables)[:nd, :width].copy_(meta.decode_block_tables)
        self.seq_lens[:nd].copy_(meta.decode_seq_lens)
        self.seq_lens[nd:b].zero_()
        if cascade:
            g, width = meta.decode_group_tables.shape
            self.group_tables[:g, :width].copy_(meta.decode_group_tables)
            self.group_ranges[:, :g].copy_(meta.decode_group_ranges)
            self.group_ranges[1, g:].zero_()  # unused groups: no rows
        if chunk:
            width = meta.prefill_block_tables.shape[1]
            self.prefill_table[:, :width].copy_(meta.prefill_block_tables)
            self.prefill_ranges.copy_(meta.prefill_ranges)
            self.prefill_ranges[0].fill_(b)  # the chunk's first row in the buffers

    def reset(self) -> None:
        for buf in (self.seq_lens, self.group_ranges, self.prefill_ranges):
            buf.zero_()
        self.slots.fill_(-1)


class StepGraphs:
    def __init__(
        self,
        forward: Callable[..., torch.Tensor],  # (ids, positions, meta, logits_indices) -> logits
        *,
        max_batch: int,
        max_blocks: int,  # decode block-table width: ceil(decode context bound / block_size)
        device: torch.device,
        capture: bool = True,
        max_groups: int = 32,  # shared-prefix groups a graphed step may have (0: none)
        max_chunk: int = 0,  # the longest prompt chunk a mixed graph takes (0: none)
        max_prefill_tokens: int = 0,  # a graphed chunk's longest context (cached + chunk)
        block_size: int = 16,
        max_wide_blocks: int = 0,  # wide graphs' table width (<= max_blocks: no wide graphs)
        layer_group: list[int] | None = None,  # each layer's KV group (window groups)
    ) -> None:
        self.forward, self.max_blocks, self.device = forward, max_blocks, device
        self.buckets = batch_buckets(max_batch)
        self.chunks = chunk_buckets(max_chunk if max_prefill_tokens > 0 else 0)
        self.max_groups = max_groups
        self.max_prefill_tokens = max_prefill_tokens
        self.capture = capture
        top = self.buckets[-1]
        tokens = top + (self.chunks[-1] if self.chunks else 0)
        self.input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.max_wide_blocks = max_wide_blocks if max_wide_blocks > max_blocks else 0
        prefill_blocks = -(-max_prefill_tokens // block_size) if self.chunks else 0
        self.layer_group = layer_group
        self.kv_groups = [
            _TableBuffers(
                tokens, top, max_blocks, self.max_wide_blocks, max_groups if g == 0 else 0,
                prefill_blocks, device,
            )
            for g in range(1 + max(layer_group or [0]))
        ]  # fmt: skip
        first = self.kv_groups[0]  # group 0's buffers, by their names
        self.slots, self.tables, self.wide_tables = first.slots, first.tables, first.wide_tables
        self.seq_lens, self.group_tables = first.seq_lens, first.group_tables
        self.group_ranges, self.prefill_table = first.group_ranges, first.prefill_table
        self.prefill_ranges = first.prefill_ranges
        self.logit_rows = torch.zeros(top + 1, dtype=torch.long, device=device)
        # decode keys, captured at start; mixed keys join self.metas on first use
        self.keys = [GraphKey(b, False) for b in self.buckets]
        if max_groups:
            self.keys += [GraphKey(b, True) for b in self.buckets if b >= 2]
        self.metas: dict[GraphKey, AttentionMetadata | GroupedAttention] = {}
        self.logits: dict[GraphKey, torch.Tensor] = {}  # views of _out, per graph
        self._out: torch.Tensor | None = None  # [top bucket + 1, vocab]: every graph's logits
        self.graphs: dict[GraphKey, object] = {}
        self.first_use_captures = 0  # graphs captured on first use (GraphKey.on_first_use)
        self.launches: Counter[GraphKey] = Counter()  # replays of each graph so far
        self.first_launches: FirstLaunches | None = None  # the latest _launch_new's times
        self._pool = self._stream = None
        if capture:
            self._capture_all()

    def _meta(self, key: GraphKey) -> AttentionMetadata | GroupedAttention:
        meta = self.metas.get(key)
        if meta is not None:
            return meta
        metas = [
            bufs.meta(key if g == 0 else key._replace(cascade=False), self.max_prefill_tokens)
            for g, bufs in enumerate(self.kv_groups)
        ]
        meta = metas[0] if self.layer_group is None else GroupedAttention(metas, self.layer_group)
        self.metas[key] = meta
        return meta

    def _run(self, key: GraphKey) -> torch.Tensor:
        b, _, chunk, _ = key
        rows = self.logit_rows[: b + 1] if chunk else None
        ids, positions = self.input_ids[: b + chunk], self.positions[: b + chunk]
        return self.forward(ids, positions, self._meta(key), rows)

    def _capture_all(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        start = time.perf_counter()
        plain = [k for k in self.keys if not k.cascade]
        cascade = [k for k in self.keys if k.cascade]
        with torch.cuda.stream(self._stream):
            self._capture(plain)
            try:
                self._capture(cascade)
            except RuntimeError as e:  # plain graphs still serve; cascade steps run eagerly
                log.warning("shared-prefix decode graphs not captured (%s); they run eagerly", e)
                for key in cascade:
                    self.graphs.pop(key, None)
                self.max_groups = 0
            self._launch_new(sorted(self.graphs))
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        torch.cuda.synchronize(self.device)
        wide = (
            f", and decode contexts of {self.max_blocks + 1} to {self.max_wide_blocks} blocks,"
            if self.max_wide_blocks
            else ""
        )
        log.info(
            "captured %d decode CUDA graphs in %.1f s: batch sizes %s, plain and with up to %d "
            "shared-prefix groups; steps with one prompt chunk of up to %s tokens%s capture "
            "theirs on first use",
            len(self.graphs),
            time.perf_counter() - start,
            self.buckets,
            self.max_groups,
            self.chunks[-1] if self.chunks else 0,
            wide,
        )

    def _capture(self, keys) -> None:
        """Each graph copies its logits into one shared buffer: a graph's own output would stay
        allocated for as long as the graph lives (73 graphs x [b, vocab] float32 is ~2 GiB at
        Llama-3's vocabulary), while its other memory goes back to the pool for the next."""
        for key in sorted(keys, reverse=True):  # largest first: the pool fits the rest after it
            warm = self._run(key)  # warm-up: compiles the kernels outside the capture
            if self._out is None:
                top = self.buckets[-1] + 1
                self._out = torch.empty(top, warm.shape[1], dtype=warm.dtype, device=self.device)
            del warm
            self._capture_one(key)

    def _capture_one(self, key: GraphKey, error_mode: str = "global") -> None:
        out = self._out[: key.rows + (1 if key.chunk else 0)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self._pool, stream=self._stream, capture_error_mode=error_mode
        ):
            out.copy_(self._run(key))
        self.logits[key] = out
        self.graphs[key] = graph

    def _launch_new(self, keys: list[GraphKey]) -> None:
        """Launch each of these newly captured graphs once, now, while every row of the
        buffers is padding (the launch writes no KV and reads no block, as their eager
        warm-ups did), on the current stream; twice in fact, to log what a first launch costs
        against a later one.

        torch instantiates a graph when its capture ends, but the driver uploads it to the
        device at its first launch (cudaGraphUpload would do it ahead; torch does not expose
        it). Without this, the first step that replays a graph pays that, and a graph captured
        between jobs (`capture_chunk_buckets`) meets its first step in a timed run: the long
        prompt's last chunk is a remainder, so possibly a bucket the warm-up never replayed.
        `first_launches` keeps the times, for the benchmark to report whether a first launch
        costs more."""
        if not keys:
            return
        stream = torch.cuda.current_stream(self.device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record(stream)
        host = []
        for mark in marks[1:]:
            start = time.perf_counter()
            for key in keys:
                self.graphs[key].replay()
                self.launches[key] += 1
            host.append((time.perf_counter() - start) * 1e3)
            mark.record(stream)
        marks[2].synchronize()
        times = FirstLaunches(
            len(keys),
            host[0],
            marks[0].elapsed_time(marks[1]),
            host[1],
            marks[1].elapsed_time(marks[2]),
        )
        self.first_launches = times
        log.info(
            "launched %d new CUDA graphs ahead of their first step: %.1f ms on the host and "
            "%.1f ms on the device the first time, %.1f and %.1f ms again",
            *times,
        )

    def _capture_on_first_use(self, key: GraphKey) -> bool:
        """A mixed or wide step's graph, after the step ran eagerly (its warm-up). The graph
        context waits for the device; the other threads of a worker may use CUDA meanwhile
        ("thread_local"). A failed capture turns that kind of graph off (mixed: every step
        with a chunk; wide: every step with a long context), not the engine (False)."""
        start = time.perf_counter()
        try:
            self._capture_one(key, error_mode="thread_local")
        except RuntimeError as e:
            kind = "mixed-step" if key.chunk else "wide decode"
            log.warning("a %s CUDA graph failed to capture (%s); they run eagerly", kind, e)
            if key.chunk:
                self.chunks = []
            if key.wide:
                self.max_wide_blocks = 0
            return False
        self.first_use_captures += 1
        log.debug(
            "captured the CUDA graph of %d decodes%s + a %d-token chunk%s in %.0f ms",
            key.rows,
            f" (tables of {self.max_wide_blocks} blocks)" if key.wide else "",
            key.chunk,
            " with shared-prefix groups" if key.cascade else "",
            (time.perf_counter() - start) * 1e3,
        )
        return True

    def missing_chunk_graphs(self) -> list[GraphKey]:
        """For every (decode bucket, groups, wide tables) that has met a prompt chunk, the
        chunk buckets whose graphs are not captured yet, largest first."""
        kinds = {(k.rows, k.cascade, k.wide) for k in self.graphs if k.chunk}
        keys = [GraphKey(b, cascade, c, wide) for b, cascade, wide in kinds for c in self.chunks]
        return sorted((k for k in keys if k not in self.graphs), reverse=True)

    def reset_to_padding(self) -> None:
        """The buffers as at start: every row padding (slot -1, no lengths, no group rows,
        an empty chunk, sampling row 0), so a run of any graph writes no KV and reads no
        block. Queued on the stream: a replay queued before it still reads the old values."""
        for buf in (self.input_ids, self.positions, self.logit_rows):
            buf.zero_()
        for bufs in self.kv_groups:
            bufs.reset()

    def capture_chunk_buckets(self) -> int:
        """Capture the graphs `missing_chunk_graphs` names, now; returns how many.

        Timed chunks pick their buckets from step times, so a run can meet a bucket an earlier
        run did not, and its first step waits for the capture (tens of ms: one long token gap).
        Call between runs, with no step in flight (the benchmarks do, after the warm-up). The
        buffers go back to all padding first (`reset_to_padding`), so each graph's eager
        warm-up writes no KV and reads no block; the next step fills what it uses. The new
        graphs are then launched on those buffers (`_launch_new`), so the first step to replay
        one does not pay its upload. A failed capture turns mixed graphs off, as on first use."""
        keys = self.missing_chunk_graphs()
        if not self.capture or not keys:
            return 0
        self.reset_to_padding()
        start = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        captured: list[GraphKey] = []
        with torch.cuda.stream(self._stream):
            for key in keys:
                self._run(key)  # warm-up, outside the capture
                if not self._capture_on_first_use(key):
                    break
                captured.append(key)
            self._launch_new(captured)  # the buffers are still all padding
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        log.info(
            "captured %d more CUDA graphs of steps with a prompt chunk in %.1f s",
            len(captured),
            time.perf_counter() - start,
        )
        return len(captured)

    def key_for(
        self, meta: AttentionMetadata | GroupedAttention, num_tokens: int, num_rows: int
    ) -> GraphKey | None:
        """The graph of a step of `num_tokens` tokens sampling `num_rows` rows, or None: a
        decode step that fits the buckets, the table width (wide tables past max_blocks) and
        the group buffers, possibly with one prompt chunk after the decodes that fits a chunk
        bucket. With KV groups, every group's tables must fit too."""
        if isinstance(meta, GroupedAttention):
            if self.layer_group is None:
                return None
            keys = [self._key_for(m, num_tokens, num_rows) for m in meta.groups]
            if any(k is None for k in keys):
                return None
            wide = any(k.wide for k in keys)
            return keys[0]._replace(wide=wide)
        if self.layer_group is not None:
            return None
        return self._key_for(meta, num_tokens, num_rows)

    def _key_for(self, meta: AttentionMetadata, num_tokens: int, num_rows: int) -> GraphKey | None:
        nd = meta.num_decode_tokens
        width = meta.decode_block_tables.shape[1]
        if not 0 < nd <= self.buckets[-1] or width > max(self.max_blocks, self.max_wide_blocks):
            return None
        wide = width > self.max_blocks
        groups = meta.decode_groups
        if groups and not (
            self.max_groups > 0
            and meta.decode_group_ranges is not None
            and len(groups) <= self.max_groups
            and nd >= 2
            and meta.decode_group_tables.shape[1] <= self.max_blocks
        ):
            return None
        b = self.buckets[bisect.bisect_left(self.buckets, nd)]
        if not meta.prefills:
            return GraphKey(b, bool(groups), 0, wide) if num_tokens == nd else None
        if len(meta.prefills) != 1 or not self.chunks or num_rows > b + 1:
            return None
        span = meta.prefills[0]
        if (
            span.query_start != nd
            or nd + span.query_len != num_tokens
            or span.query_len > self.chunks[-1]
            or span.context_len > self.max_prefill_tokens
            or meta.prefill_ranges is None  # packed by the runner (not built by hand)
            or meta.prefill_block_tables is None
            or meta.prefill_block_tables.shape[1] > self.prefill_table.shape[1]
        ):
            return None
        chunk = self.chunks[bisect.bisect_left(self.chunks, span.query_len)]
        return GraphKey(b, bool(groups), chunk, wide)

    def run(
        self,
        key: GraphKey,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata | GroupedAttention,
        logits_rows: torch.Tensor,  # rows of the step (as laid out by the runner) to sample
    ) -> torch.Tensor:  # [len(logits_rows), vocab] float32
        """Fill the static buffers of `key` (from key_for) and replay its graph."""
        b, cascade, chunk, wide = key
        metas = meta.groups if isinstance(meta, GroupedAttention) else [meta]
        nd = metas[0].num_decode_tokens
        m = input_ids.shape[0] - nd  # the chunk's tokens (0 in a decode step)
        for buf, src in ((self.input_ids, input_ids), (self.positions, positions)):
            _place(buf, src, nd, b, m)
        for g, (bufs, group_meta) in enumerate(zip(self.kv_groups, metas)):
            bufs.fill(key if g == 0 else key._replace(cascade=False), group_meta, m)
        k = logits_rows.shape[0]
        if chunk:
            # the step's rows -> the buffers' rows (the chunk moved from nd to b)
            shifted = torch.where(logits_rows >= nd, logits_rows + (b - nd), logits_rows)
            self.logit_rows[:k].copy_(shifted)
            self.logit_rows[k : b + 1].zero_()  # a valid row for the unused entries
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.launches[key] += 1
            logits = self.logits[key]
        else:  # not captured (CPU, or a mixed or wide step's first time): the same buffers
            logits = self._run(key)
            if key.on_first_use and self.capture:  # (key_for gave it: that kind is on)
                self._capture_on_first_use(key)
        return logits[:k] if chunk else logits[:nd][logits_rows]


def _place(buf: torch.Tensor, src: torch.Tensor, nd: int, b: int, m: int) -> None:
    """The step's nd decode rows at the top of buf, its m chunk rows from row b."""
    buf[:nd].copy_(src[:nd])
    if m:
        buf[b : b + m].copy_(src[nd:])

"""CUDA graphs for decode steps: capture the whole forward once per batch-size bucket, replay.

A decode step of B sequences launches a few kernels per layer; at small batches the GPU
waits on those launches. A captured graph replays them all with one call. Graphs have fixed
shapes and fixed addresses, so every input lives in a static buffer sized for the largest
bucket, and a step of n sequences runs the graph of the smallest bucket b >= n:

    rows 0 .. n-1   the real decodes: token, position, slot, block table, context length
    rows n .. b-1   padding: slot -1 (the KV write skips it), context length 0 (attention
                    writes zeros); their logits are computed and dropped

Decode steps with shared-prefix (cascade) groups replay a second graph per bucket, whose
groups live in static buffers too: up to `max_groups` groups, each a range of decode rows
and its shared blocks; unused groups have 0 rows (their programs exit at once), and the
shared-prefix launch is sized for the bucket's rows (the largest a group can be):

    group_tables  [max_groups, max_blocks]   each group's shared blocks
    group_ranges  [3, max_groups]            first row, rows (0 = unused), shared tokens

Steps with prefill chunks, more groups, or longer contexts run eagerly. Buckets are captured
largest first and share one memory pool (NOTES.md). Needs the triton backend, whose kernels
skip negative slots and never read device values on the host.

Without CUDA, `capture=False` runs the same static-buffer path eagerly: the padding and
bucketing logic is then testable on the CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (vLLM's spacing): little padding waste."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[..., torch.Tensor],  # model forward: (ids, positions, meta) -> logits
        *,
        max_batch: int,
        max_blocks: int,  # block-table width: ceil(max_model_len / block_size)
        device: torch.device,
        capture: bool = True,
        max_groups: int = 32,  # shared-prefix groups a graphed step may have (0: none)
    ) -> None:
        self.forward, self.max_blocks, self.device = forward, max_blocks, device
        self.buckets = batch_buckets(max_batch)
        self.max_groups = max_groups
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.group_tables = torch.zeros(max_groups, max_blocks, dtype=torch.int32, device=device)
        self.group_ranges = torch.zeros(3, max_groups, dtype=torch.int32, device=device)
        # (bucket, cascade) -> metadata, graph, logits; cascade graphs for buckets of 2 or more
        self.keys = [(b, False) for b in self.buckets]
        if max_groups:
            self.keys += [(b, True) for b in self.buckets if b >= 2]
        self.metas = {key: self._meta(*key) for key in self.keys}
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}  # views of _out, per graph
        self._out: torch.Tensor | None = None  # [top bucket, vocab]: every graph's logits
        self.graphs: dict[tuple[int, bool], object] = {}
        if capture:
            self._capture_all()

    def _meta(self, b: int, cascade: bool) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:b],
            num_decode_tokens=b,
            decode_block_tables=self.tables[:b],
            decode_seq_lens=self.seq_lens[:b],
            prefills=[],
        )
        if cascade:
            meta.decode_group_tables = self.group_tables
            meta.decode_group_ranges = self.group_ranges
            meta.decode_group_max_rows = b
        return meta

    def _run(self, key: tuple[int, bool]) -> torch.Tensor:
        b = key[0]
        return self.forward(self.input_ids[:b], self.positions[:b], self.metas[key])

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        start = time.perf_counter()
        plain = [k for k in self.keys if not k[1]]
        cascade = [k for k in self.keys if k[1]]
        with torch.cuda.stream(stream):
            self._capture(plain, pool, stream)
            try:
                self._capture(cascade, pool, stream)
            except RuntimeError as e:  # plain graphs still serve; cascade steps run eagerly
                log.warning("shared-prefix decode graphs not captured (%s); they run eagerly", e)
                for key in cascade:
                    self.graphs.pop(key, None)
                self.max_groups = 0
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode CUDA graphs in %.1f s: batch sizes %s, plain and with up to %d "
            "shared-prefix groups",
            len(self.graphs),
            time.perf_counter() - start,
            self.buckets,
            self.max_groups,
        )

    def _capture(self, keys, pool, stream) -> None:
        """Each graph copies its logits into one shared buffer: a graph's own output would stay
        allocated for as long as the graph lives (73 graphs x [b, vocab] float32 is ~2 GiB at
        Llama-3's vocabulary), while its other memory goes back to the pool for the next."""
        for key in sorted(keys, reverse=True):  # largest first: the pool fits the rest after it
            warm = self._run(key)  # warm-up: compiles the kernels outside the capture
            if self._out is None:
                top = self.buckets[-1]
                self._out = torch.empty(top, warm.shape[1], dtype=warm.dtype, device=self.device)
            del warm
            out = self._out[: key[0]]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out.copy_(self._run(key))
            self.logits[key] = out
            self.graphs[key] = graph

    def supports(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A decode step that fits the buckets, the table width and the group buffers."""
        if (
            meta.prefills
            or meta.num_decode_tokens != num_tokens
            or not 0 < num_tokens <= self.buckets[-1]
            or meta.decode_block_tables.shape[1] > self.max_blocks
        ):
            return False
        if not meta.decode_groups:
            return True
        return (
            self.max_groups > 0
            and meta.decode_group_ranges is not None
            and len(meta.decode_groups) <= self.max_groups
            and num_tokens >= 2
            and meta.decode_group_tables.shape[1] <= self.max_blocks
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [n, vocab] float32
        """The step's logits, one row per decode, from the smallest bucket that holds it."""
        n = input_ids.shape[0]
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:b].fill_(-1)
        self.tables[:n, :width].copy_(meta.decode_block_tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.seq_lens[n:b].zero_()
        cascade = bool(meta.decode_groups)
        if cascade:
            g, width = meta.decode_group_tables.shape
            self.group_tables[:g, :width].copy_(meta.decode_group_tables)
            self.group_ranges[:, :g].copy_(meta.decode_group_ranges)
            self.group_ranges[1, g:].zero_()  # unused groups: no rows
        key = (b, cascade)
        graph = self.graphs.get(key)
        if graph is None:  # not captured (CPU): the same buffers, run eagerly
            return self._run(key)[:n]
        graph.replay()
        return self.logits[key][:n]

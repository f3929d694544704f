"""CUDA graphs for decode steps: capture the whole forward once per batch-size bucket, replay.

A decode step of B sequences launches a few kernels per layer; at small batches the GPU
waits on those launches. A captured graph replays them all with one call. Graphs have fixed
shapes and fixed addresses, so every input lives in a static buffer sized for the largest
bucket, and a step of n sequences runs the graph of the smallest bucket b >= n:

    rows 0 .. n-1   the real decodes: token, position, slot, block table, context length
    rows n .. b-1   padding: slot -1 (the KV write skips it), context length 0 (attention
                    writes zeros); their logits are computed and dropped

Only plain decode steps replay (no prefill chunks, no shared-prefix groups: their shapes
change every step); the rest run eagerly. Buckets are captured largest first and share one
memory pool (NOTES.md). Needs the triton backend, whose kernels skip negative slots and never
read device values on the host.

Without CUDA, `capture=False` runs the same static-buffer path eagerly: the padding and
bucketing logic is then testable on the CPU.
"""

from __future__ import annotations

import bisect
import logging
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
    ) -> None:
        self.forward, self.max_blocks, self.device = forward, max_blocks, device
        self.buckets = batch_buckets(max_batch)
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.metas = {b: self._meta(b) for b in self.buckets}
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, object] = {}
        if capture:
            self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b],
            num_decode_tokens=b,
            decode_block_tables=self.tables[:b],
            decode_seq_lens=self.seq_lens[:b],
            prefills=[],
        )

    def _run(self, b: int) -> torch.Tensor:
        return self.forward(self.input_ids[:b], self.positions[:b], self.metas[b])

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # largest first: the pool fits the rest after it
                self._run(b)  # warm-up: compiles the kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[b] = self._run(b)
                self.graphs[b] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def supports(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A plain decode step that fits the buckets and the table width."""
        return (
            not meta.prefills
            and not meta.decode_groups
            and meta.num_decode_tokens == num_tokens
            and 0 < num_tokens <= self.buckets[-1]
            and meta.decode_block_tables.shape[1] <= self.max_blocks
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
        graph = self.graphs.get(b)
        if graph is None:  # not captured (CPU): the same buffers, run eagerly
            return self._run(b)[:n]
        graph.replay()
        return self.logits[b][:n]

"""Turns a scheduled step into flat tensors, runs the model once, samples.

chunks:      seq A: 1 token (decode)   seq B: 4 tokens (prefill chunk at offset 32)
input_ids:   [a9 | b32 b33 b34 b35]
positions:   [ 9 |  32  33  34  35]
slots:       table[pos // block_size] * block_size + pos % block_size
logits rows: the last token of every chunk that reaches the end of its sequence; for a
             speculative chunk (last token + k drafts), all of its 1 + k tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvbatch.engine.attention.cascade import DecodeGroup, find_shared_prefixes
from kvbatch.engine.attention.metadata import AttentionMetadata, GroupedAttention, PrefillSpan
from kvbatch.engine.core.sequence import Sequence
from kvbatch.engine.exec.launched_step import LaunchedStep, StepResult
from kvbatch.engine.exec.penalties import token_histories
from kvbatch.engine.exec.sampler import Sampler, SamplingTensors
from kvbatch.engine.kv.device_tables import (
    DeviceBlockTables,
    gather_decode_tables,
    plan_decode_tables,
)
from kvbatch.engine.kv.hybrid import HybridKVCacheManager
from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.kv.layer_tensors import kv_block_bytes, layer_kv_tensors
from kvbatch.engine.kv.layout import KVLayout
from kvbatch.engine.kv.state_slots import StatefulMeta
from kvbatch.engine.kv.stateful import StatefulKVManager
from kvbatch.engine.layers.kernel_op import use_kernels
from kvbatch.engine.models.llama import LlamaForCausalLM
from kvbatch.engine.pooling.pooler import Pooler, pooling_chunks
from kvbatch.engine.sched.scheduler import ScheduledChunk, SchedulerOutput
from kvbatch.engine.spec.rejection import verify
from kvbatch.engine.structured.batch_mask import fill_token_bitmask

# Decode steps whose longest context exceeds this replay "wide" graphs, captured on first use
# (engine/exec/cuda_graphs.py): a graph's block-table width is fixed, and the decode kernel cuts
# contexts into splits by that width (kernels/), so the graphs of ordinary steps keep it short.
GRAPH_MAX_CONTEXT = 8192
# Decode steps with more shared-prefix groups than this run eagerly (`rag` at 256 running
# sequences has 8: 32 chunks per document).
GRAPH_MAX_GROUPS = 32


def kv_bytes_per_block(
    model: LlamaForCausalLM,
    block_size: int,
    dtype: torch.dtype,
    layout: KVLayout | None = None,
) -> int:
    """One block's K and V over its layers: every layer's, or with window groups the
    layout's slots (engine/kv/layout.py)."""
    return kv_block_bytes(model.config, block_size, dtype, layout)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv: KVCacheManager | HybridKVCacheManager,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend,
        seed: int = 0,
        cascade: bool = True,
        kv_dtype: torch.dtype | None = None,  # the pool's (kv_cache_dtype); default: dtype
    ) -> None:
        cfg = model.config
        self.model, self.kv, self.device, self.backend = model, kv, device, backend
        # The layers run the kernels of the attention backend's kind (engine/layers/).
        use_kernels(model, backend.name)
        self.block_size = block_size
        self.cascade = cascade  # shared-prefix attention for decodes (engine/attention/cascade.py)
        # One tensor per layer: [2 (K, V), blocks, block_size, kv_heads, head_dim], in the
        # model's dtype or E4M3 (kv_cache_dtype="fp8"). Zeroed, so masked-out padding
        # positions never hold NaN (0 * NaN would poison attention). With window groups
        # (engine/kv/layout.py) one tensor per slot, each layer given its slot's.
        # Layers of another shape and KV-shared layers: engine/kv/layer_tensors.py.
        layout = kv.layout if isinstance(kv, HybridKVCacheManager) else None
        self.kv_caches = layer_kv_tensors(
            cfg, layout, num_blocks, block_size, kv_dtype or dtype, device
        )
        # Each group's block tables (one group without window groups), kept on the device;
        # the first is the one cascade attention reads (group 0's when it holds KV).
        self.sources = [kv] if layout is None else kv.tables
        self.tables = [DeviceBlockTables(device) for _ in self.sources]
        self.layer_group = (
            None
            if layout is None
            else [
                layout.group_of(cfg.kv_owner(i)) - (0 if kv.full_has_kv else 1)
                for i in range(cfg.num_layers)
            ]
        )
        if layout is not None and not kv.full_has_kv:
            self.cascade = False  # every group has a window: no shared prefix stays whole
        # a hybrid model's linear-attention states (engine/kv/stateful.py)
        self.states = kv if isinstance(kv, StatefulKVManager) else None
        self.sampler = Sampler(seed=seed)
        self.pooler = Pooler()  # embedding requests' partial states between their chunks
        self.step_graphs = None  # set by capture_step_graphs (CUDA, triton backend)
        # The last launched step's sampled tokens, on the device: where a sequence's pending
        # token (async scheduling, Sequence.pending_row) is read from.
        self._last_sampled: torch.Tensor | None = None

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run a step and wait for its tokens."""
        return self.launch(out).result()

    def launch(self, out: SchedulerOutput, started=None) -> LaunchedStep:
        """Queue a step's forward and sampling; on CUDA this returns before they have run.
        `started`: the step's start_clock (engine/exec/launched_step.py), to time it."""
        input_ids, meta, logits_rows, sampling_seqs = self._prepare(out)
        pooling = pooling_chunks(meta.chunks) if self.pooler.active else []
        if pooling:  # prefill-only (embedding) requests in the step
            return self._launch_pooling(
                input_ids, meta, logits_rows, sampling_seqs, pooling, started
            )
        captured = self._graphs_captured()
        key = self._graph_key(input_ids, meta, logits_rows)
        logits = self._forward(key, input_ids, meta, logits_rows)
        if self._graphs_captured() != captured:  # the step waited for a graph's capture: its
            started = None  # time is no measure of a step's (engine/sched/step_cost.py)
        launched = self._sample(logits, sampling_seqs, started)
        launched.padded_chunk = key.chunk if key is not None else 0
        return launched

    def _launch_pooling(
        self, input_ids, meta: _StepMeta, logits_rows, sampling_seqs, pooling, started
    ) -> LaunchedStep:
        """A step with prefill-only chunks (engine/pooling/) runs eagerly, keeping every row's
        final hidden state for the pooler; the pooling requests' logits rows are dropped
        before sampling (they are never sampled), the other requests' are sampled as usual."""
        hidden: list[torch.Tensor] = []
        logits = self.model(
            input_ids,
            meta.positions,
            self.kv_caches,
            meta.attention,
            self.backend,
            logits_indices=logits_rows,
            final_hidden=hidden,
        )
        done, vectors = self.pooler.add_step(hidden[0], pooling)
        logits, sampling_seqs = self.pooler.drop_pooling_rows(logits, sampling_seqs)
        launched = self._sample(logits, sampling_seqs, started)
        if done:
            seqs = {seq.request_id: seq for seq, _ in meta.chunks if seq.pooling is not None}
            launched.attach_pooled([seqs[key] for key in done], vectors)
        return launched

    def _sample(self, logits, sampling_seqs: list[Sequence], started) -> LaunchedStep:
        if not sampling_seqs:
            return LaunchedStep([], None)
        if any(s.draft_token_ids for s in sampling_seqs):  # speculative decoding: verify
            vocab = self.model.config.vocab_size
            tokens, sampled = verify(self.sampler, logits, sampling_seqs, vocab)
            return LaunchedStep(sampling_seqs, sampled, tokens, started)
        params = [s.params for s in sampling_seqs]
        if all(p.argmax_only for p in params):  # e.g. a greedy batch job: skip the tensors
            sampled = self.sampler.argmax(logits)
        else:
            vocab = self.model.config.vocab_size
            tensors = SamplingTensors.from_params(
                params,
                # the index of the token being sampled: pending tokens come before it
                [s.num_output_tokens + s.num_pending for s in sampling_seqs],
                vocab,
                self.device,
                histories=token_histories(sampling_seqs),
                token_bitmask=fill_token_bitmask(
                    [s.grammar for s in sampling_seqs], vocab, self.device
                ),
            )
            sampled = self.sampler(logits, tensors)
        self._last_sampled = sampled.token_ids
        return LaunchedStep(sampling_seqs, sampled, started=started)

    def _graphs_captured(self) -> int:
        return 0 if self.step_graphs is None else self.step_graphs.first_use_captures

    def graph_chunk_buckets(self) -> list[int]:
        """The sizes a step's one prompt chunk is padded up to by its CUDA graph (none without
        mixed-step graphs): the step cost model sizes chunks against them."""
        return self.step_graphs.chunks if self.step_graphs is not None else []

    def _graph_key(self, input_ids, meta: _StepMeta, logits_rows):
        """The step's graph (a decode step, maybe with one short prompt chunk), or None."""
        if self.step_graphs is None:
            return None
        return self.step_graphs.key_for(meta.attention, input_ids.shape[0], logits_rows.shape[0])

    def _forward(self, key, input_ids, meta: _StepMeta, logits_rows) -> torch.Tensor:
        """Replay the graph of `key` (from _graph_key) when there is one, else run eagerly."""
        if key is not None:
            return self.step_graphs.run(key, input_ids, meta.positions, meta.attention, logits_rows)
        return self.model(
            input_ids,
            meta.positions,
            self.kv_caches,
            meta.attention,
            self.backend,
            logits_indices=logits_rows,
        )

    def capture_step_graphs(
        self, max_batch: int, max_model_len: int, max_chunk: int = 0, capture: bool = True
    ):
        """Decode steps of up to max_batch sequences, and those with one prompt chunk of up
        to max_chunk tokens, replay CUDA graphs from now on (engine/exec/cuda_graphs.py);
        capture=False runs the same padded path eagerly (CPU tests)."""
        from kvbatch.engine.exec.cuda_graphs import StepGraphs

        def forward(ids, positions, meta, logits_indices=None):
            return self.model(
                ids, positions, self.kv_caches, meta, self.backend, logits_indices=logits_indices
            )

        self.step_graphs = StepGraphs(
            forward,
            max_batch=max_batch,
            max_blocks=-(-min(max_model_len, GRAPH_MAX_CONTEXT) // self.block_size),
            max_wide_blocks=-(-max_model_len // self.block_size),
            device=self.device,
            capture=capture,
            max_groups=GRAPH_MAX_GROUPS if self.cascade else 0,
            max_chunk=max_chunk,
            max_prefill_tokens=max_model_len,
            block_size=self.block_size,
            layer_group=self.layer_group,
        )

    def _prepare(self, out: SchedulerOutput):
        """Host side of a step, vectorised with numpy (at 512 decodes, Python per sequence
        would cost more than the GPU's step), then one host-to-device copy. The block tables
        themselves stay on the device (engine/kv/device_tables.py): the copy carries the
        entries that changed since the last step and the step's rows, and the step's tables
        are gathered there. With window groups each group's tables go the same way; only the
        first group's decodes are grouped by shared prefix."""
        batch = self._order_chunks(out)
        tokens = token_layout(batch, self.sources[0].table_array, self.block_size)
        sample_idx, logits_rows = logits_rows_of(batch.chunks, tokens.query_start, batch.lens)
        prefill_ranges = np.stack([tokens.query_start, batch.lens, tokens.context_lens])
        prefill_ranges = prefill_ranges[:, batch.num_decodes :]
        groups = [
            _GroupTables.of(
                batch,
                tokens,
                self.block_size,
                batch.groups,
                batch.rows,
                batch.num_blocks,
                self.sources[0],
                tokens.slots,
            )
        ]
        for source in self.sources[1:]:
            rows, num_blocks = source.table_rows([id(c.seq) for c in batch.chunks])
            slots = slots_of(
                source.table_array, rows, tokens.seq_of_token, tokens.positions, self.block_size
            )
            groups.append(
                _GroupTables.of(batch, tokens, self.block_size, [], rows, num_blocks, source, slots)
            )
        ids_d, positions_d, logits_rows_d, prefill_ranges_d, pending_at_d, pending_rows_d, *rest = (
            to_device_at_once(
                [
                    tokens.ids,
                    tokens.positions,
                    logits_rows,
                    prefill_ranges,
                    tokens.pending_at,
                    tokens.pending_rows,
                    *(a for g in groups for a in g.arrays()),
                ],
                self.device,
            )
        )
        if len(tokens.pending_at):
            ids_d[pending_at_d] = self._last_sampled[pending_rows_d]
        metas = []
        for g, tables in zip(groups, self.tables):
            slots_d, rows_d, num_blocks_d, *plan_d = rest[: g.num_arrays]
            rest = rest[g.num_arrays :]
            *plan_d, change_rows, change_cols, change_values = plan_d
            tables.apply(g.changes.shape, change_rows, change_cols, change_values)
            metas.append(
                self._attention_metadata(
                    batch,
                    tokens,
                    g,
                    tables,
                    slots_d,
                    rows_d,
                    num_blocks_d,
                    prefill_ranges_d,
                    plan_d,
                )
            )
        attention = (
            metas[0] if self.layer_group is None else GroupedAttention(metas, self.layer_group)
        )
        if self.states is not None:
            step = self.states.state_step(
                batch.chunks, batch.num_decodes, batch.starts, tokens.query_start, self.device
            )
            attention = StatefulMeta(attention, step, self.states.pool)
        meta = _StepMeta(positions_d, attention, batch.chunks)
        return ids_d, meta, logits_rows_d, [batch.chunks[i].seq for i in sample_idx]

    def _order_chunks(self, out: SchedulerOutput) -> _Batch:
        """The step's chunks in launch order with their table rows: decodes first (as the
        scheduler gives them), and with cascade attention the decodes that share a prefix
        made adjacent, each run of them a group (engine/attention/cascade.py)."""
        chunks = out.chunks
        num_decodes = sum(1 for c in chunks if c.num_new_tokens == 1)  # decodes come first
        rows, num_blocks = self.sources[0].table_rows([id(c.seq) for c in chunks])
        starts = np.fromiter((c.seq.num_computed_tokens for c in chunks), np.int64, len(chunks))
        groups: list[tuple[int, int, int]] = []
        if self.cascade and num_decodes >= 2:
            order, groups = find_shared_prefixes(
                self.sources[0].table_array,
                starts[:num_decodes] + 1,
                self.block_size,
                rows=rows[:num_decodes],
            )
            if groups:  # sharers adjacent; prefill chunks stay where they are
                perm = np.concatenate([order, np.arange(num_decodes, len(chunks))])
                chunks = [chunks[i] for i in perm]
                rows, num_blocks, starts = rows[perm], num_blocks[perm], starts[perm]
        lens = np.fromiter((c.num_new_tokens for c in chunks), np.int64, len(chunks))
        return _Batch(chunks, num_decodes, rows, num_blocks, starts, lens, groups)

    def _attention_metadata(
        self, batch: _Batch, tokens: _TokenLayout, group: _GroupTables,
        tables: DeviceBlockTables, slots_d, rows_d, num_blocks_d, prefill_ranges_d, plan_d,
    ) -> AttentionMetadata:  # fmt: skip
        """One group's AttentionMetadata for the step from its device arrays: the decodes'
        tables gathered on the device (private parts and shared groups), every prefill
        chunk's table in one tensor."""
        d, bs, plan = batch.num_decodes, self.block_size, group.plan
        private, private_lens, group_tables, group_ranges = gather_decode_tables(
            tables, plan, rows_d[:d], num_blocks_d[:d], *plan_d
        )
        num_chunks = len(batch.chunks)
        prefill_tables = (  # every prefill chunk's table in one tensor
            tables.gather(rows_d[d:], int(group.num_blocks[d:].max()))
            if num_chunks > d
            else tables.empty
        )
        query_start, context_lens = tokens.query_start, tokens.context_lens
        prefills = [
            PrefillSpan(
                int(query_start[i]),
                int(batch.lens[i]),
                int(context_lens[i]),
                prefill_tables[i - d, : -(-int(context_lens[i]) // bs)],
            )
            for i in range(d, num_chunks)
        ]
        groups = group.cascade_groups
        return AttentionMetadata(
            slot_mapping=slots_d,
            num_decode_tokens=d,
            decode_block_tables=private,
            decode_seq_lens=private_lens,
            prefills=prefills,
            decode_groups=[
                DecodeGroup(start, end, group_tables[i, :n])
                for i, (start, end, n) in enumerate(groups)
            ],
            prefill_block_tables=prefill_tables,
            prefill_ranges=prefill_ranges_d if prefills else None,
            decode_group_tables=group_tables if groups else None,
            decode_group_ranges=group_ranges if groups else None,
            decode_group_max_rows=max((end - start for start, end, _ in groups), default=0),
        )


@dataclass
class _Batch:
    """A step's chunks in launch order and, per chunk, its table row and token counts."""

    chunks: list[ScheduledChunk]
    num_decodes: int  # the first num_decodes chunks are decodes (1 token each)
    rows: np.ndarray  # [chunks] each chunk's row in the KV manager's table array
    num_blocks: np.ndarray  # [chunks] blocks in that row's table
    starts: np.ndarray  # [chunks] tokens already computed (the chunk's first position)
    lens: np.ndarray  # [chunks] tokens computed this step
    groups: list[tuple[int, int, int]]  # shared-prefix decode groups: first, end, shared blocks


@dataclass
class _GroupTables:
    """One KV group's part of a step on the host: its rows, slots, decode-table layout and
    the table entries changed since the last step."""

    rows: np.ndarray  # [chunks] in launch order
    num_blocks: np.ndarray
    slots: np.ndarray  # [tokens]
    plan: object  # DecodeTablePlan
    changes: object  # TableChanges
    cascade_groups: list[tuple[int, int, int]]

    @classmethod
    def of(cls, batch, tokens, block_size, cascade_groups, rows, num_blocks, source, slots):
        d = batch.num_decodes
        plan = plan_decode_tables(
            rows[:d], num_blocks[:d], tokens.context_lens[:d], cascade_groups, block_size
        )
        return cls(rows, num_blocks, slots, plan, source.take_table_changes(), cascade_groups)

    def arrays(self) -> list[np.ndarray]:
        """What travels to the device: slots, rows, table lengths, the decode plan, then the
        changed entries."""
        c = self.changes
        return [self.slots, self.rows, self.num_blocks, *self.plan.arrays(), c.rows, c.cols,
                c.values]  # fmt: skip

    @property
    def num_arrays(self) -> int:
        return 3 + len(self.plan.arrays()) + 3


def slots_of(
    host_tables: np.ndarray, rows: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray,
    block_size: int,
) -> np.ndarray:  # fmt: skip
    """[tokens] each token's slot in one group's tables (rows: the chunks' rows there):
    table[pos // block_size] * block_size + pos % block_size."""
    return (
        host_tables[rows[seq_of_token], positions // block_size] * block_size
        + positions % block_size
    )


@dataclass
class _TokenLayout:
    """Every token of a step, flat: its id, position and KV slot, and where each chunk's
    tokens start."""

    ids: np.ndarray  # [tokens] int64
    pending_at: np.ndarray  # indices in ids of tokens still on the device (async scheduling)
    pending_rows: np.ndarray  # their rows in the last step's sampled tokens
    query_start: np.ndarray  # [chunks] each chunk's first token in ids
    positions: np.ndarray  # [tokens]
    seq_of_token: np.ndarray  # [tokens] the chunk each token belongs to
    slots: np.ndarray  # [tokens] in the first group's tables (slots_of)
    context_lens: np.ndarray  # [chunks] tokens in the KV after this step


def token_layout(batch: _Batch, host_tables: np.ndarray, block_size: int) -> _TokenLayout:
    """Token ids, positions and slots for every token of the step. A decode whose token the
    host has not seen yet (async scheduling) gets a placeholder, filled on the device from
    the last step's sampled tokens; a speculative chunk is the last token, then the drafts."""
    ids: list[int] = []
    pending_at: list[int] = []  # ids still on the device: index in ids, row in _last_sampled
    pending_rows: list[int] = []
    for (seq, n), start in zip(batch.chunks, batch.starts.tolist()):
        part = seq.token_ids[start : start + n]
        if len(part) < n:
            if seq.num_pending:  # a decode of a token the host has not seen yet
                pending_at.append(len(ids))
                pending_rows.append(seq.pending_row)
                part = [0]
            else:  # a speculative chunk: the last token, then the drafts
                part = part + list(seq.draft_token_ids[: n - len(part)])
        ids.extend(part)
    lens, starts, rows = batch.lens, batch.starts, batch.rows
    query_start = np.cumsum(lens) - lens
    seq_of_token = np.repeat(np.arange(len(batch.chunks)), lens)
    positions = starts[seq_of_token] + np.arange(len(ids)) - query_start[seq_of_token]
    slots = slots_of(host_tables, rows, seq_of_token, positions, block_size)
    return _TokenLayout(
        ids=np.array(ids, dtype=np.int64),
        pending_at=np.array(pending_at, dtype=np.int64),
        pending_rows=np.array(pending_rows, dtype=np.int64),
        query_start=query_start,
        positions=positions,
        seq_of_token=seq_of_token,
        slots=slots,
        context_lens=starts + lens,
    )


def logits_rows_of(
    chunks: list[ScheduledChunk], query_start: np.ndarray, lens: np.ndarray
) -> tuple[list[int], np.ndarray]:
    """(the chunks that sample, the rows of the flat tokens whose logits are computed): each
    sampling chunk's last token, and for a speculative chunk all of its 1 + k tokens. Not
    every 1-token chunk samples: it may be a prompt's chunk cut by the token budget."""
    sample_idx = [i for i, c in enumerate(chunks) if c.samples]
    logits_rows = (query_start + lens - 1)[sample_idx]
    num_rows = [1 + len(chunks[i].seq.draft_token_ids) for i in sample_idx]
    if any(r > 1 for r in num_rows):  # speculative chunks are scored at every position
        logits_rows = np.concatenate(
            [np.arange(e - r + 1, e + 1) for e, r in zip(logits_rows, num_rows)]
        )
    return sample_idx, logits_rows


def to_device_at_once(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 arrays -> views of one device tensor with their shapes: one host-to-device copy
    per step instead of one per array. On CUDA the copy goes through pinned memory without
    blocking: a blocking copy would wait for every step already queued on the stream, which
    is what async scheduling overlaps with this one's preparation."""
    flat = np.concatenate([a.astype(np.int64, copy=False).ravel() for a in arrays])
    buf = torch.from_numpy(flat)
    if device.type == "cuda":
        buf = buf.pin_memory().to(device, non_blocking=True)
    else:
        buf = buf.to(device)
    views, at = [], 0
    for a in arrays:
        views.append(buf[at : at + a.size].view(a.shape))
        at += a.size
    return views


@dataclass
class _StepMeta:
    positions: torch.Tensor
    attention: AttentionMetadata
    chunks: list | None = None  # the step's ScheduledChunks in row order (decodes reordered)

"""The KV manager of a hybrid linear-attention model: the paged KV blocks of its
full-attention layers (a KVCacheManager) and the state slots of its linear layers
(engine/kv/state_slots.py), behind KVCacheManager's interface, so the scheduler runs unchanged.

- Each sequence holds one state slot from admission to its end; a new sequence's states start
  at zero, or as a copy of a snapshot (below). Admission fails, as for blocks, when no slot is
  free (snapshots are evicted first, least recently used).
- Preemption frees the slot with the blocks: the sequence is recomputed from its tokens (from
  a snapshot when one matches).
- n > 1: `fork` shares nothing (returns 0), so each child is queued as a new sequence and
  starts from the snapshot at the prompt's branch point, or recomputes. Sharing the parent's
  KV without a state at the same token would be wrong.
- Speculative decoding is refused for these models by the engine: a rejected draft token
  would have to be taken back out of the recurrent state.

Prefix reuse. A recurrent state is a function of the whole prefix and cannot be cut at any
token, so a KV prefix hit is only usable up to a point where a snapshot of the states exists:
get_computed_blocks cuts the KV hit back to the longest snapshotted prefix. Snapshots are taken
where sharing happens, the branch points of the prompts the engine knows of (`note_prompt`):
for a sequence being admitted, each block boundary where the number of prompts still to come
that share its prefix drops (the end of a shared system prompt, the end of each document, the
point where n > 1 children diverge). The forward copies the states out at those offsets
(StateStep), so each distinct prefix is computed once, as for attention models.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from kvbatch.engine.kv.kv_cache import ComputedBlocks, KVCacheManager, default_hash
from kvbatch.engine.kv.state_slots import (
    SnapshotAt,
    StatePool,
    StateShape,
    StateSpan,
    StateStep,
)
from kvbatch.engine.model.linear_attention import LinearAttentionConfig

log = logging.getLogger(__name__)


class StatefulKVManager:
    def __init__(self, kv: KVCacheManager, pool: StatePool, max_snapshots: int) -> None:
        self.kv, self.pool = kv, pool
        self.block_size = kv.block_size
        self.max_snapshots = max_snapshots if kv.enable_prefix_caching else 0
        self._slots: dict[Hashable, int] = {}
        self._snapshots: OrderedDict[tuple[int, ...], int] = OrderedDict()  # prefix -> slot
        self._snapshot_lengths: Counter[int] = Counter()
        self._planned: dict[Hashable, list[int]] = {}  # seq -> prefix lengths to snapshot
        self._to_come: Counter[int] = Counter()  # block-chain hash -> prompts not yet admitted
        self._admitted: set[Hashable] = set()  # sequences counted out of _to_come
        # the step being scheduled: where each sequence's chunk ends, the snapshot a new one
        # starts from, the snapshots its chunk fills, and the slots those read or fill
        self._progress: dict[Hashable, int] = {}
        self._inits: dict[Hashable, int] = {}
        self._pending: dict[Hashable, list[SnapshotAt]] = {}
        self._busy: set[int] = set()
        self._last_lookup: tuple[Sequence[int] | None, int] = (None, 0)  # prompt, KV hit
        self.num_snapshots_taken = 0

    def __getattr__(self, name: str):
        """Everything else (tables, statistics, integrity) is the KV manager's."""
        return getattr(self.kv, name)

    # -- what is coming -------------------------------------------------------------------

    def note_prompt(self, token_ids: Sequence[int]) -> None:
        """A prompt the engine will run: its prefixes count as shared with those to come."""
        if self.max_snapshots:
            self._to_come.update(self._chain(token_ids))

    def _chain(self, token_ids: Sequence[int]) -> list[int]:
        bs, h, out = self.block_size, None, []
        for i in range(len(token_ids) // bs):
            h = default_hash(h, tuple(token_ids[i * bs : (i + 1) * bs]))
            out.append(h)
        return out

    def _plan_snapshots(
        self, seq_id: Hashable, token_ids: Sequence[int], start: int, kv_hit: int = 0
    ) -> None:
        """The branch points of a sequence being admitted (see the module doc), past `start`;
        it no longer counts as to come. `kv_hit`: the KV cache's hit, longer than the
        snapshot's when a branch point was missed (its sharer was not known yet): a branch
        point too, so the prefix is recomputed once, not by every later sharer."""
        if not self.max_snapshots:
            return
        chain = self._chain(token_ids)
        if seq_id not in self._admitted:  # a preempted sequence is not counted out twice
            self._admitted.add(seq_id)
            for h in chain:
                self._to_come[h] -= 1
                if self._to_come[h] <= 0:
                    del self._to_come[h]
        # A later prompt's hit leaves its last token to compute: one that ends where the
        # sharing does reads the snapshot a block earlier.
        bs, last = self.block_size, (len(token_ids) - 1) // self.block_size * self.block_size
        points = set()
        for j, h in enumerate(chain):
            sharers = self._to_come[h]
            after = self._to_come[chain[j + 1]] if j + 1 < len(chain) else 0
            if sharers > 0 and after < sharers:
                points.update({(j + 1) * bs, min((j + 1) * bs, last)})
        points.add(kv_hit)
        points = sorted(
            p for p in points if p > start and tuple(token_ids[:p]) not in self._snapshots
        )
        if points:
            self._planned[seq_id] = points

    # -- lookup and allocation ------------------------------------------------------------

    def get_computed_blocks(self, token_ids: Sequence[int]) -> ComputedBlocks:
        """The KV hit, cut back to the longest prefix whose states are snapshotted."""
        hit = self.kv.get_computed_blocks(token_ids)
        self._last_lookup = (token_ids, hit.num_tokens)
        for length in sorted(self._snapshot_lengths, reverse=True):
            if length <= hit.num_tokens and tuple(token_ids[:length]) in self._snapshots:
                return ComputedBlocks(hit.block_ids[: length // self.block_size], length)
        return ComputedBlocks([], 0)

    def can_allocate(
        self, seq_id: Hashable, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        room = seq_id in self._slots or self.pool.num_free + self._num_evictable() > 0
        return room and self.kv.can_allocate(seq_id, num_new_tokens, computed)

    def allocate_slots(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> bool:
        """As KVCacheManager's; a new sequence also takes a slot (its states zeroed, or to be
        copied from the snapshot of its hit), and the snapshots its chunk reaches are
        reserved now, so that a sequence admitted later in the same step finds them: the
        forward fills a snapshot before any later chunk of the step reads it."""
        new = seq_id not in self._slots
        start = (computed.num_tokens if computed is not None else 0) if new else None
        source = self._snapshots.get(tuple(token_ids[:start])) if start else None
        if source is not None:
            self._busy.add(source)  # not evicted to make room for this very sequence
        if new and not self._make_room(1):
            return False
        if not self.kv.allocate_slots(seq_id, token_ids, num_new_tokens, computed):
            return False
        if new:
            self._slots[seq_id] = self.pool.acquire()
            self._progress[seq_id] = start
            if source is not None:
                self._snapshots.move_to_end(tuple(token_ids[:start]))
                self._inits[seq_id] = source
            looked_up, kv_hit = self._last_lookup
            self._plan_snapshots(seq_id, token_ids, start, kv_hit if looked_up is token_ids else 0)
        self._reserve_snapshots(seq_id, token_ids, num_new_tokens)
        return True

    def _reserve_snapshots(self, seq_id: Hashable, token_ids, num_new_tokens: int) -> None:
        """Slots for the planned snapshots within this chunk, registered as they will be once
        the step has run."""
        start = self._progress[seq_id]
        end = self._progress[seq_id] = start + num_new_tokens
        planned = self._planned.get(seq_id)
        while planned and planned[0] <= end:
            p = planned.pop(0)
            key = tuple(token_ids[:p])
            if p <= start or key in self._snapshots or not self._make_room(1):
                continue
            slot = self.pool.acquire()
            self._snapshots[key] = slot
            self._snapshot_lengths[p] += 1
            self._busy.add(slot)
            self._pending.setdefault(seq_id, []).append(SnapshotAt(p - start, slot))
            self.num_snapshots_taken += 1
            while len(self._snapshots) > self.max_snapshots and self._evict_one():
                pass

    def _num_evictable(self) -> int:
        return sum(1 for slot in self._snapshots.values() if slot not in self._busy)

    def _make_room(self, n: int) -> bool:
        """n free slots, evicting the least recently used snapshots that this step does not
        read or fill."""
        while self.pool.num_free < n:
            if not self._evict_one():
                return False
        return True

    def _evict_one(self) -> bool:
        victim = next((k for k, slot in self._snapshots.items() if slot not in self._busy), None)
        if victim is None:
            return False
        self._drop_snapshot(victim)
        return True

    def _drop_snapshot(self, key: tuple[int, ...]) -> None:
        self.pool.release(self._snapshots.pop(key))
        self._snapshot_lengths[len(key)] -= 1
        if not self._snapshot_lengths[len(key)]:
            del self._snapshot_lengths[len(key)]

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> int:
        return 0  # see the module doc

    def free(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> None:
        """Free the blocks and the slot; snapshots reserved for a chunk that will not run
        (the sequence preempted in the step that reserved them) go too."""
        self.kv.free(seq_id, token_ids)
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self.pool.release(slot)
        for snapshot in self._pending.pop(seq_id, []):
            key = next(k for k, s in self._snapshots.items() if s == snapshot.slot)
            self._busy.discard(snapshot.slot)
            self._drop_snapshot(key)
        for table in (self._planned, self._progress, self._inits):
            table.pop(seq_id, None)
        if token_ids is not None:  # finished (a preempted one is freed without its tokens)
            self._admitted.discard(seq_id)

    def truncate(self, seq_id: Hashable, token_ids: Sequence[int], num_tokens: int) -> None:
        raise RuntimeError("a hybrid model's recurrent states cannot be rolled back")

    # -- the step -------------------------------------------------------------------------

    def state_step(
        self, chunks, num_decodes: int, starts, query_start, device: torch.device
    ) -> StateStep:
        """Each chunk's slot, the snapshot its states start from (a new sequence's hit), and
        the snapshots its tokens reach (reserved by allocate_slots)."""
        decode_slots: list[int] = []
        decode_inits: list[tuple[int, int]] = []
        decode_snapshots: list[tuple[int, int]] = []
        prefills = []
        for i, (seq, n) in enumerate(chunks):
            key = id(seq)
            slot, init = self._slots[key], self._inits.pop(key, -1)
            snaps = tuple(self._pending.pop(key, ()))
            if i < num_decodes:
                decode_slots.append(slot)
                if init >= 0:
                    decode_inits.append((i, init))
                decode_snapshots += [(i, s.slot) for s in snaps]
            else:
                prefills.append(StateSpan(int(query_start[i]), n, slot, snaps, init))
        self._busy.clear()
        slots = torch.tensor(decode_slots, dtype=torch.int64).to(device)
        return StateStep(num_decodes, slots, prefills, decode_snapshots, decode_inits)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        self.pool.check_integrity(list(self._slots.values()) + list(self._snapshots.values()))


class StatePlan(NamedTuple):
    num_blocks: int  # the KV pool's, after the state slots took their share
    num_slots: int  # running sequences' slots and snapshots'
    max_snapshots: int
    slot_bytes: int


def plan_state_slots(
    state_bytes_per_slot: int,
    num_blocks: int,
    block_bytes: int,
    max_num_seqs: int,
    blocks_fixed: bool,
) -> StatePlan:
    """Split the KV budget (num_blocks x block_bytes) between KV blocks and state slots: a
    slot for each of max_num_seqs sequences and as many for snapshots, the states taking at
    most half the budget. With the pool's blocks fixed (num_kv_blocks) the slots come on top."""
    if blocks_fixed:
        return StatePlan(num_blocks, 2 * max_num_seqs, max_num_seqs, state_bytes_per_slot)
    budget = num_blocks * block_bytes
    fit = max(2, budget // 2 // max(state_bytes_per_slot, 1))
    running = min(max_num_seqs, max(1, fit // 2))
    snapshots = min(max_num_seqs, max(1, fit - running))
    slots = running + snapshots
    num_blocks = max(1, (budget - slots * state_bytes_per_slot) // block_bytes)
    return StatePlan(num_blocks, slots, snapshots, state_bytes_per_slot)


def state_shape(linear: LinearAttentionConfig) -> StateShape:
    return StateShape(
        num_layers=len(linear.linear_layers),
        conv_dim=linear.conv_dim,
        conv_kernel=linear.conv_kernel,
        num_heads=linear.num_value_heads,
        key_dim=linear.key_head_dim,
        value_dim=linear.value_head_dim,
    )


def stateful_manager(
    kv: KVCacheManager,
    plan: StatePlan,
    linear: LinearAttentionConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    full_attention_blocks: int,
) -> StatefulKVManager:
    """The pool and its manager, and the startup line: the state slots, and how many
    sequences of max_model_len run at once against a full-attention model of the same shape
    (full_attention_blocks: the blocks the same budget would hold with KV in every layer)."""
    pool = StatePool(state_shape(linear), plan.num_slots, dtype, device)
    blocks_per_seq = -(-max_model_len // kv.block_size)
    hybrid = min(plan.num_slots - plan.max_snapshots, kv.num_blocks // max(blocks_per_seq, 1))
    log.info(
        "state cache: %d slots of %.2f MiB (%d running sequences, %d snapshots) for %d "
        "linear-attention layers; sequences of max_model_len=%d at once: %d (KV blocks and "
        "state slots together), where a full-attention model of the same shape holds %d",
        plan.num_slots,
        plan.slot_bytes / 2**20,
        plan.num_slots - plan.max_snapshots,
        plan.max_snapshots,
        len(linear.linear_layers),
        max_model_len,
        hybrid,
        full_attention_blocks // max(blocks_per_seq, 1),
    )
    return StatefulKVManager(kv, pool, plan.max_snapshots)

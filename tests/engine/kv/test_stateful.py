"""The state slots and snapshots of a hybrid model's KV manager, without a model: where
snapshots are planned, that a later sharer starts from one, eviction, preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.kv.state_slots import SnapshotAt, StatePool, StateShape
from kvbatch.engine.kv.stateful import StatefulKVManager, plan_state_slots

BS = 4
SHAPE = StateShape(num_layers=1, conv_dim=3, conv_kernel=2, num_heads=1, key_dim=2, value_dim=2)


@dataclass(eq=False)
class Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    draft_token_ids: list = field(default_factory=list)


def _manager(slots: int = 8, snapshots: int = 4) -> StatefulKVManager:
    pool = StatePool(SHAPE, slots, torch.float32, torch.device("cpu"))
    return StatefulKVManager(KVCacheManager(64, BS, True), pool, snapshots)


def _run_prompt(kv: StatefulKVManager, seq: Seq):
    """Admit seq and compute its whole prompt in one step; the step's StateStep."""
    hit = kv.get_computed_blocks(seq.token_ids)
    n = len(seq.token_ids) - hit.num_tokens
    assert kv.allocate_slots(id(seq), seq.token_ids, n, hit)
    seq.num_computed_tokens = hit.num_tokens
    step = kv.state_step([(seq, n)], 0, [hit.num_tokens], [0], torch.device("cpu"))
    seq.num_computed_tokens += n
    return hit.num_tokens, step


SYS, D1, D2 = [1] * 6, [2] * 6, [3] * 7


def test_snapshots_at_the_branch_points_and_a_sharer_starts_from_one():
    kv = _manager()
    a, b, c = Seq(SYS + D1 + [7, 7, 7]), Seq(SYS + D1 + [8, 8]), Seq(SYS + D2 + [9])
    for s in (a, b, c):
        kv.note_prompt(s.token_ids)
    hit, step = _run_prompt(kv, a)
    assert hit == 0
    # the system prompt ends in block 1 (tokens 4..7 mix sys and D1): A, B and C share block
    # 0 only; A and B share blocks 0-2 (12 tokens, D1 ends at 12)
    (span,) = step.prefills
    assert [s.offset for s in span.snapshots] == [4, 12]
    assert span.init_from == -1
    hit, step = _run_prompt(kv, b)
    assert hit == 12
    assert step.prefills[0].init_from == span.snapshots[1].slot
    assert step.prefills[0].snapshots == ()
    hit, step = _run_prompt(kv, c)
    assert hit == 4 and step.prefills[0].init_from == span.snapshots[0].slot
    kv.check_integrity()
    for s in (a, b, c):
        kv.free(id(s), s.token_ids)
    kv.check_integrity()
    assert kv.pool.num_free == kv.pool.num_slots - 2  # the two snapshots stay cached


def test_without_a_snapshot_a_kv_hit_is_not_used():
    kv = _manager()
    a, b = Seq(SYS + D1 + [7]), Seq(SYS + D1 + [8])
    kv.note_prompt(a.token_ids)  # b is not announced: no branch point planned for it
    _run_prompt(kv, a)
    kv.free(id(a), a.token_ids)
    hit, step = _run_prompt(kv, b)
    assert hit == 0  # the KV of 12 tokens is cached, but no state of them
    # ... and the KV hit's end is snapshotted now: a third sharer starts there
    assert [s.offset for s in step.prefills[0].snapshots] == [12]
    c = Seq(SYS + D1 + [9])
    assert _run_prompt(kv, c)[0] == 12


def test_snapshots_are_evicted_least_recently_used():
    kv = _manager(slots=4, snapshots=1)
    a, b = Seq(SYS + D1 + [7]), Seq(SYS + D1 + [8])
    for s in (a, b):
        kv.note_prompt(s.token_ids)
    _, step = _run_prompt(kv, a)
    # two branch points planned (block 0 shared with b... and the document's end); one kept
    assert len(kv._snapshots) == 1
    kv.free(id(a), a.token_ids)
    assert _run_prompt(kv, b)[0] == 12
    kv.check_integrity()


def test_a_preempted_sequence_gives_back_the_snapshots_its_step_reserved():
    kv = _manager()
    a, b = Seq(SYS + D1 + [7]), Seq(SYS + D1 + [8])
    for s in (a, b):
        kv.note_prompt(s.token_ids)
    assert kv.allocate_slots(id(a), a.token_ids, len(a.token_ids), None)
    assert kv._pending[id(a)] == [SnapshotAt(12, kv._snapshots[tuple(a.token_ids[:12])])]
    kv.free(id(a))  # preempted before its step ran: the snapshot was never filled
    assert not kv._snapshots and kv.pool.num_free == kv.pool.num_slots
    kv.check_integrity()


def test_the_plan_splits_the_budget_and_keeps_fixed_blocks():
    plan = plan_state_slots(1000, num_blocks=1000, block_bytes=100, max_num_seqs=4,
                            blocks_fixed=False)  # fmt: skip
    assert plan.num_slots == 8 and plan.max_snapshots == 4
    assert plan.num_blocks == (1000 * 100 - 8 * 1000) // 100
    tight = plan_state_slots(1000, 100, 100, 4, blocks_fixed=False)
    assert tight.num_slots * 1000 <= 100 * 100 // 2  # the states take at most half
    assert tight.num_blocks * 100 + tight.num_slots * 1000 <= 100 * 100
    fixed = plan_state_slots(1000, 100, 100, 4, blocks_fixed=True)
    assert fixed.num_blocks == 100 and fixed.num_slots == 8

"""LengthBatcher: batches built around the oldest waiting request, nearest lengths first,
within the padded-token budget and the request cap."""

from __future__ import annotations

import random

from kvbatch.engine.encoder.batches import EncoderRequest, LengthBatcher


def batcher_of(lengths: list[int]) -> LengthBatcher:
    b = LengthBatcher()
    for i, n in enumerate(lengths):
        b.add(EncoderRequest(f"r{i}", None, [1] * n, i))
    return b


def lengths_of(batch) -> list[int]:
    return [len(r) for r in batch]


def test_the_docstring_example():
    b = batcher_of([7, 3, 40, 5, 12, 5, 9, 6])  # r0 (7 tokens) is the oldest
    assert lengths_of(b.next_batch(max_tokens=40, max_seqs=16)) == [3, 5, 5, 6, 7]
    assert lengths_of(b.waiting.values()) == [40, 12, 9]
    b = batcher_of([7, 3, 40, 5, 12, 5, 9, 6])
    assert lengths_of(b.next_batch(max_tokens=40, max_seqs=3)) == [5, 6, 7]  # nearest first


def test_the_oldest_runs_even_when_over_the_budget_and_the_cap_holds():
    b = batcher_of([100, 2, 2, 2])
    assert lengths_of(b.next_batch(max_tokens=50, max_seqs=8)) == [100]
    assert lengths_of(b.next_batch(max_tokens=50, max_seqs=2)) == [2, 2]


def test_random_queues_drain_within_the_budget_oldest_first():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 40))]
        b = batcher_of(lengths)
        budget, cap = rng.randint(1, 256), rng.randint(1, 8)
        seen: list[str] = []
        while b.has_unfinished():
            oldest = next(iter(b.waiting))
            batch = b.next_batch(budget, cap)
            assert oldest in {r.request_id for r in batch}  # nobody waits forever
            assert len(batch) <= cap
            assert len(batch) == 1 or len(batch) * max(lengths_of(batch)) <= budget
            seen += [r.request_id for r in batch]
        assert sorted(seen) == sorted(f"r{i}" for i in range(len(lengths)))


def test_removed_requests_never_run():
    b = batcher_of([3, 4, 5])
    assert b.remove("r1") and not b.remove("r1")
    assert [r.request_id for r in b.next_batch(100, 8)] == ["r0", "r2"]
    assert not b.has_unfinished() and b.next_batch(100, 8) == []

"""TableRows mirrors block tables in one array; KVCacheManager keeps it in step."""

from __future__ import annotations

import random

from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.kv.table_rows import TableRows


def test_rows_grow_in_both_directions_and_are_zero_past_each_table():
    rows = TableRows(rows=2, width=2)
    a, b = rows.acquire(), rows.acquire()  # the second forces more rows (row 0 stays zero)
    assert 0 not in (a, b) and a != b
    rows.write(a, 0, [5, 6, 7])  # wider than the array
    rows.write(b, 0, [9])
    rows.write(a, 3, [8])
    assert rows.array[[a, b, 0], :4].tolist() == [[5, 6, 7, 8], [9, 0, 0, 0], [0] * 4]
    rows.clear(a, 2, 4)
    assert rows.array[a, :4].tolist() == [5, 6, 0, 0]
    rows.release(a, 2)
    assert not rows.array[a].any() and rows.acquire() == a


def random_table_op(kv, live, rng, names, sizes, p_allocate=0.5, p_truncate=0.2) -> None:
    """One random allocation (of one of `sizes` tokens, for one of `names`), speculative
    truncation or free on `kv`; `live` maps each sequence to its tokens."""
    op = rng.random()
    if op < p_allocate or not live:
        name = rng.choice(names)
        tokens = live.setdefault(name, [])
        n = rng.choice(sizes)
        new = [rng.randint(0, 3) for _ in range(n)]
        if kv.allocate_slots(name, tokens + new, n):
            tokens += new
        elif not tokens:
            del live[name]
    elif op < p_allocate + p_truncate:
        name = rng.choice(sorted(live))
        tokens = live[name]
        keep = rng.randint(kv._seqs[name].num_hashed * kv.block_size, len(tokens))
        del tokens[keep:]
        kv.truncate(name, tokens, keep)
    else:
        name = rng.choice(sorted(live))
        kv.free(name)
        del live[name]


def test_block_tables_follow_allocation_truncation_and_free():
    rng = random.Random(0)
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    live: dict[str, list[int]] = {}
    for _ in range(300):
        random_table_op(kv, live, rng, "abcdefgh", range(1, 10))
        kv.check_integrity()  # includes: each mirrored row equals the table, zero after it
        names = sorted(live) + ["unknown"]
        rows, num_blocks = kv.table_rows(names)
        for row, n, name in zip(kv.table_array[rows].tolist(), num_blocks.tolist(), names):
            assert row[:n] == kv.block_table(name) and not any(row[n:])

"""Block accounting, prefix caching and eviction of kvbatch.engine.kv.kv_cache (CPU, milliseconds)."""

from __future__ import annotations

import random

import pytest

from kvbatch.engine.kv.kv_cache import ComputedBlocks, KVCacheManager, block_hashes

BS = 16


def toks(start: int, n: int) -> list[int]:
    """n distinct token ids from start: prompts built from disjoint ranges never collide."""
    return list(range(start, start + n))


def admit(kv: KVCacheManager, seq_id, prompt: list[int]) -> ComputedBlocks:
    """What the scheduler does for a new request: look up, then allocate the rest."""
    computed = kv.get_computed_blocks(prompt)
    assert kv.allocate_slots(seq_id, prompt, len(prompt) - computed.num_tokens, computed)
    return computed


def free_list(kv: KVCacheManager) -> list[int]:
    return list(kv._free)


# -- prefix hits ----------------------------------------------------------------------------


@pytest.mark.parametrize("first_finished", [False, True])
def test_shared_three_block_prefix_is_hit(first_finished):
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    system = toks(1000, 3 * BS)
    a = system + toks(2000, 5)
    b = system + toks(3000, 20)
    admit(kv, "a", a)
    if first_finished:
        kv.free("a")
    computed = admit(kv, "b", b)
    assert computed.num_tokens == 48
    assert computed.block_ids == kv.block_table("b")[:3]
    if not first_finished:
        assert computed.block_ids == kv.block_table("a")[:3]
    assert kv.num_computed_tokens("b") == len(b)
    assert len(kv.block_table("b")) == 5  # 3 shared + ceil(20 / 16)
    kv.check_integrity()


def test_hit_is_capped_so_the_last_token_is_computed():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    prompt = toks(0, 3 * BS)
    admit(kv, "a", prompt + [7])  # registers all three full blocks
    assert kv.get_computed_blocks(prompt).num_tokens == 32
    assert kv.get_computed_blocks(prompt + [7]).num_tokens == 48
    assert kv.get_computed_blocks(prompt[:1]).num_tokens == 0
    assert kv.get_computed_blocks([]).num_tokens == 0
    computed = admit(kv, "b", prompt)
    assert computed.num_tokens == 32
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]  # recomputed, a private twin
    kv.check_integrity()


def test_block_hashes_matches_the_managers_chain():
    prompt = toks(0, 3 * BS + 5)
    hashes = block_hashes(prompt, BS)
    assert len(hashes) == 3
    assert hashes == block_hashes(prompt[: 3 * BS], BS)
    assert block_hashes(toks(1, 3 * BS), BS)[0] != hashes[0]
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, "a", prompt)
    assert [kv._blocks[b].hash for b in kv.block_table("a")[:3]] == hashes
    with pytest.raises(ValueError):
        block_hashes(prompt, 0)


# -- allocation, reference counts, free order -------------------------------------------------


def snapshot(kv: KVCacheManager):
    blocks = [(b.ref_cnt, b.hash, b.tokens, b.parent, b.gen) for b in kv._blocks]
    seqs = {k: (list(s.table), s.num_tokens, s.num_hashed) for k, s in kv._seqs.items()}
    return blocks, seqs, free_list(kv), dict(kv._cached)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    system = toks(0, 3 * BS)
    admit(kv, "a", system + [1])  # 4 blocks: the pool is full
    assert kv.num_free_blocks == 0
    before = snapshot(kv)
    assert not kv.can_allocate("b", 1)
    assert not kv.allocate_slots("b", [5], 1)
    assert not kv.allocate_slots("a", system + [1, 2], 16)  # growing a running seq
    assert snapshot(kv) == before
    kv.check_integrity()

    # Reviving cached blocks (ref 0) takes them out of the free list too: 3 revived + 3 fresh
    # is more than 4, although 3 fresh alone would fit.
    kv.free("a")
    prompt = system + toks(100, 40)
    computed = kv.get_computed_blocks(prompt)
    assert computed.num_tokens == 48
    before = snapshot(kv)
    assert not kv.can_allocate("b", 40, computed)
    assert not kv.allocate_slots("b", prompt, 40, computed)
    assert snapshot(kv) == before
    assert kv.can_allocate("b", 16, computed)
    assert kv.allocate_slots("b", prompt, 16, computed)
    assert kv.num_free_blocks == 0
    kv.check_integrity()


def test_ref_counts_with_shared_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    system = toks(0, 2 * BS)
    admit(kv, "a", system + toks(100, 3))
    admit(kv, "b", system + toks(200, 3))
    admit(kv, "c", system + toks(300, 3))
    shared = kv.block_table("a")[:2]
    assert kv.block_table("b")[:2] == kv.block_table("c")[:2] == shared
    assert [kv._blocks[b].ref_cnt for b in shared] == [3, 3]
    assert kv.num_free_blocks == 16 - 2 - 3
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert [kv._blocks[b].ref_cnt for b in shared] == [1, 1]
    assert not set(shared) & set(free_list(kv))  # still held by c
    kv.check_integrity()
    kv.free("c")
    kv.free("c")  # unknown / already freed: ignored
    assert kv.num_free_blocks == 16
    assert kv.stats().usage == 0.0
    kv.check_integrity()


def test_free_is_tail_first_and_eviction_is_lru():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = toks(0, 4 * BS + 3)  # 4 full (hashed) blocks + 1 partial
    admit(kv, "a", a)
    ta = kv.block_table("a")
    assert ta == [0, 1, 2, 3, 4]
    kv.free("a")
    # Partial block to the head (reused first), hashed ends before their beginnings.
    assert free_list(kv) == [4, 5, 6, 7, 3, 2, 1, 0]
    kv.check_integrity()

    # A seq needing 6 fresh blocks takes the partial block, the unused ones, then the ends.
    assert kv.allocate_slots("x", toks(10_000, 6 * BS), 6 * BS)
    assert kv.block_table("x") == [4, 5, 6, 7, 3, 2]
    # The shared beginning of a's prompt outlived its end.
    assert kv.get_computed_blocks(a).block_ids == [0, 1]
    kv.check_integrity()


def test_lru_across_sequences():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = toks(0, 2 * BS), toks(1000, 2 * BS)
    admit(kv, "a", a)
    admit(kv, "b", b)
    kv.free("a")  # a's blocks freed first: least recently used
    kv.free("b")
    assert kv.allocate_slots("x", toks(5000, BS), BS)
    assert kv.allocate_slots("y", toks(6000, BS), BS)
    assert kv.get_computed_blocks(a + [1]).num_tokens == 0  # both of a's blocks evicted
    assert kv.get_computed_blocks(b + [1]).num_tokens == 32
    kv.check_integrity()


def test_a_hit_revives_a_free_block_exactly_once():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    system = toks(0, 3 * BS)
    admit(kv, "a", system + [1])
    kv.free("a")
    shared = kv.get_computed_blocks(system + [2]).block_ids
    assert len(shared) == 3
    admit(kv, "b", system + [2])
    fl = free_list(kv)
    assert not set(shared) & set(fl)  # taken out of the middle of the free list
    assert len(fl) == kv.num_free_blocks == 6 - 4
    kv.check_integrity()
    # Drain the pool: nobody else may receive b's blocks.
    assert kv.allocate_slots("c", toks(500, 2 * BS), 2 * BS)
    assert not kv.allocate_slots("d", [9], 1)
    owners = kv.block_table("b") + kv.block_table("c")
    assert len(owners) == len(set(owners)) == 6
    kv.check_integrity()


# -- chunked prefill, decode, speculation -------------------------------------------------------


def test_blocks_are_hashed_as_chunks_and_decodes_fill_them():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = toks(0, 40)
    assert kv.allocate_slots("a", prompt, 20)  # first chunk: one full block
    assert kv.num_computed_tokens("a") == 20
    assert kv.get_computed_blocks(prompt).num_tokens == 16
    assert kv.allocate_slots("a", prompt, 20)
    assert kv.get_computed_blocks(prompt).num_tokens == 32
    seq = list(prompt)
    for t in range(8):  # decode: each step writes the newest token
        seq.append(900 + t)
        assert kv.allocate_slots("a", seq, 1)
    assert kv.num_computed_tokens("a") == 48
    assert len(kv.block_table("a")) == 3
    assert kv.get_computed_blocks(seq + [1]).num_tokens == 48  # output block cached too
    kv.check_integrity()


def test_draft_tokens_get_slots_but_are_not_hashed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    final = toks(0, 14)
    assert kv.allocate_slots("a", final, 14)
    assert kv.allocate_slots("a", final, 4)  # 4 draft slots beyond the final tokens
    assert len(kv.block_table("a")) == 2
    assert kv.get_computed_blocks(toks(0, 16) + [1]).num_tokens == 0  # block 0 not hashed
    final = toks(0, 17)  # drafts accepted: the next call hashes the block
    assert kv.allocate_slots("a", final, 0)
    assert kv.get_computed_blocks(final).num_tokens == 16
    kv.check_integrity()


def test_racing_prefills_share_the_later_blocks():
    """A twin (the same contents computed twice) stays private, but the chain goes on."""
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    system = toks(0, 3 * BS)
    a = system + toks(1000, 2 * BS) + [7]
    b = system + toks(2000, 2 * BS) + [7]
    assert kv.allocate_slots("a", a, 2 * BS)  # a's prefill is chunked
    admit(kv, "b", b)  # b hits a's two blocks, computes the third system block itself
    assert kv.allocate_slots("a", a, len(a) - 2 * BS)  # a's third block duplicates b's
    ta, tb = kv.block_table("a"), kv.block_table("b")
    assert ta[2] != tb[2]
    computed = kv.get_computed_blocks(a)
    assert computed.block_ids == tb[:3] + ta[3:5]  # a's own document blocks are shared
    kv.check_integrity()


def test_misuse_raises():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(0, 3 * BS)
    admit(kv, "a", prompt)
    computed = kv.get_computed_blocks(prompt)
    with pytest.raises(ValueError):
        kv.allocate_slots("a", prompt, 1, computed)  # computed only starts a new seq
    with pytest.raises(ValueError):
        kv.allocate_slots("b", prompt, -1)
    with pytest.raises(ValueError):
        kv.allocate_slots("b", toks(5, 3 * BS), 1, computed)  # blocks hold other tokens
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks=0)
    kv.check_integrity()


def test_check_integrity_catches_corruption():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, "a", toks(0, 40))
    kv.check_integrity()
    kv._blocks[kv.block_table("a")[0]].ref_cnt += 1
    with pytest.raises(RuntimeError, match="ref_cnt"):
        kv.check_integrity()
    kv._blocks[kv.block_table("a")[0]].ref_cnt -= 1
    kv._free.push_tail(kv.block_table("a")[2])
    with pytest.raises(RuntimeError, match="free list"):
        kv.check_integrity()


# -- collisions -----------------------------------------------------------------------------


def tokens_only(parent, tokens):
    """A hash that ignores the parent: the same block after different prefixes collides."""
    return hash(tokens)


def test_forced_collisions_never_return_wrong_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_fn=lambda parent, tokens: 0)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    admit(kv, "a", x + y + [0])
    assert len(kv._cached) == 1  # every later block collides with a's first
    assert kv.get_computed_blocks(x + y + [0]).num_tokens == 4
    assert kv.get_computed_blocks(z + y + [0]).num_tokens == 0
    admit(kv, "b", z + y + [0])  # collides at block 0: stays unshared
    assert kv.get_computed_blocks(z + y + [0]).num_tokens == 0
    kv.check_integrity()


def test_same_second_block_after_a_different_first_block():
    kv = KVCacheManager(num_blocks=16, block_size=4, hash_fn=tokens_only)
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    admit(kv, "a", x + y + [0])
    admit(kv, "b", z + y + [0])  # b's second block hashes like a's; parent differs
    computed = kv.get_computed_blocks(z + y + [0])
    assert computed.block_ids == kv.block_table("b")[:1]  # z hit, y (a's, after x) refused
    assert kv.get_computed_blocks(x + y + [0]).block_ids == kv.block_table("a")[:2]
    kv.check_integrity()


def test_child_of_an_evicted_and_reused_parent_is_never_returned():
    kv = KVCacheManager(num_blocks=4, block_size=4, hash_fn=tokens_only)
    x, x2, y = [1, 2, 3, 4], [21, 22, 23, 24], [5, 6, 7, 8]
    r = x + y + [0]
    assert kv.get_computed_blocks(r).num_tokens == 0  # r looks up before p registers x
    assert kv.allocate_slots("p", x + [9], 4)  # p: block 0 holds x
    assert kv.allocate_slots("r", r, len(r), ComputedBlocks([], 0))
    assert kv.block_table("r") == [1, 2, 3]  # 1: twin of 0 (private); 2: y, parent block 0
    kv.free("p")  # block 0 (x) is free but still cached
    assert kv.allocate_slots("s", x2 + [9], 4)  # evicts block 0, re-registers it with x2
    assert kv.block_table("s") == [0]
    # Block 2 (y after x) must not be served after x2, although its hash and tokens match.
    computed = kv.get_computed_blocks(x2 + y + [0])
    assert computed.block_ids == [0]
    kv.check_integrity()

    # Block 2 is now unreachable: registering y after x2 displaces it instead of colliding.
    kv.free("r")
    assert free_list(kv) == [1, 3, 2]
    assert kv.allocate_slots("t", x2 + y + [0], 5, computed)
    assert kv.block_table("t") == [0, 1, 3]
    assert kv.get_computed_blocks(x2 + y + [0]).block_ids == [0, 1]
    assert kv._blocks[2].hash is None
    kv.check_integrity()


# -- random pressure ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hash_fn",
    [None, lambda p, t: hash((p, t)) % 5, lambda p, t: 0, tokens_only],
    ids=["default", "mod5", "zero", "tokens_only"],
)
def test_random_pressure(hash_fn):
    bs = 4
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=48, block_size=bs, hash_fn=hash_fn)
    prefixes = [[rng.randrange(6) for _ in range(rng.randrange(0, 5 * bs))] for _ in range(5)]
    written: dict[int, tuple[int, ...]] = {}  # block -> the whole prefix whose KV it holds
    live: dict[int, list[int]] = {}  # seq -> its tokens
    prompts: dict[int, list[int]] = {}
    hits = 0

    def record(seq_id: int, tokens: list[int], first_new_block: int) -> None:
        covered = kv.num_computed_tokens(seq_id)
        table = kv.block_table(seq_id)
        for i in range(first_new_block, len(table)):
            written[table[i]] = tuple(tokens[: min((i + 1) * bs, covered)])

    for step in range(1500):
        op = rng.random()
        if op < 0.3 or not live:  # admit a new request
            seq_id = step
            prompt = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randint(1, 12))]
            computed = kv.get_computed_blocks(prompt)
            for i, b in enumerate(computed.block_ids):
                assert written[b] == tuple(prompt[: (i + 1) * bs]), "wrong block served"
            assert computed.num_tokens <= len(prompt) - 1
            chunk = rng.randint(1, len(prompt) - computed.num_tokens)
            if kv.allocate_slots(seq_id, prompt, chunk, computed):
                hits += computed.num_tokens  # counted once the sequence starts
                live[seq_id], prompts[seq_id] = list(prompt), prompt
                record(seq_id, prompt, len(computed.block_ids))
            else:
                assert kv.block_table(seq_id) == []
        elif op < 0.8:  # one step of a running seq: a prefill chunk or a decode token
            seq_id = rng.choice(list(live))
            tokens = live[seq_id]
            done = kv.num_computed_tokens(seq_id)
            if done < len(tokens):
                n = rng.randint(1, len(tokens) - done)
            else:
                tokens.append(rng.randrange(6))
                n = 1
            first_new = done // bs  # blocks from here on are (partly) written by this step
            if kv.allocate_slots(seq_id, tokens, n):
                record(seq_id, tokens, first_new)
            elif done == len(tokens) - 1:
                tokens.pop()  # the decode did not fit: the token was never written
        else:  # finish or preempt
            seq_id = rng.choice(list(live))
            kv.free(seq_id)
            del live[seq_id]
        kv.check_integrity()

    stats = kv.stats()
    assert stats.prefix_hits == hits
    if hash_fn is None:
        assert stats.hit_rate > 0.1  # the shared prefixes are actually reused
    for seq_id in list(live):
        kv.free(seq_id)
    assert kv.num_free_blocks == 48
    kv.check_integrity()


# -- prefix caching off, stats --------------------------------------------------------------


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    system = toks(0, 3 * BS)
    admit(kv, "a", system + [1])
    computed = admit(kv, "b", system + [2])
    assert computed == ComputedBlocks([], 0)
    assert not set(kv.block_table("a")) & set(kv.block_table("b"))
    assert kv._cached == {}
    assert all(b.hash is None for b in kv._blocks)
    ta = kv.block_table("a")
    kv.free("a")
    assert free_list(kv)[:4] == ta  # unhashed blocks go to the head, reused first
    kv.check_integrity()
    stats = kv.stats()
    assert (stats.prefix_queries, stats.prefix_hits, stats.hit_rate) == (0, 0, 0.0)


def test_stats():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    stats = kv.stats()
    assert (stats.num_blocks, stats.num_free_blocks, stats.usage) == (10, 10, 0.0)
    assert stats.hit_rate == 0.0
    system = toks(0, 2 * BS)
    admit(kv, "a", system + [1, 2])  # 34 tokens looked up, 0 hit, 3 blocks
    admit(kv, "b", system + [3, 4, 5, 6])  # 36 looked up, 32 hit, 1 new block
    stats = kv.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (70, 32)
    assert stats.hit_rate == pytest.approx(32 / 70)
    assert (stats.num_free_blocks, stats.usage) == (6, pytest.approx(0.4))
    kv.free("a")
    kv.free("b")
    assert kv.stats().usage == 0.0
    kv.check_integrity()


def test_a_lookup_that_waits_for_blocks_is_counted_once():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    admit(kv, "a", toks(0, 2 * BS))  # takes both blocks
    waiting = toks(100, BS + 3)
    for _ in range(3):  # looked up every step while no block is free
        assert not kv.allocate_slots("b", waiting, len(waiting), kv.get_computed_blocks(waiting))
    assert kv.stats().prefix_queries == 2 * BS
    kv.free("a")
    assert kv.allocate_slots("b", waiting, len(waiting), kv.get_computed_blocks(waiting))
    assert kv.stats().prefix_queries == 2 * BS + len(waiting)


def test_table_rows_pad_each_table_and_keep_the_order_given():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert kv.allocate_slots("a", list(range(9)), 9)  # 3 blocks
    assert kv.allocate_slots("b", list(range(100, 104)), 4)  # 1 block
    rows, num_blocks = kv.table_rows(["b", "a", "unknown"])
    assert num_blocks.tolist() == [1, 3, 0]
    assert kv.table_array[rows, :3].tolist() == [
        kv.block_table("b") + [0, 0],
        kv.block_table("a"),
        [0, 0, 0],
    ]


def test_free_registers_blocks_filled_by_tokens_known_since_the_last_allocation():
    """Async scheduling gives a slot to a token still on the device: its block is hashed
    only once the token is known, at the latest when the sequence is freed."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    assert kv.allocate_slots("a", tokens[:7], 8)  # slot 8's token is pending
    assert kv.get_computed_blocks(tokens).num_tokens == 4
    kv.free("a", tokens[:8])  # it arrived
    assert kv.get_computed_blocks(tokens).num_tokens == 8
    kv.check_integrity()

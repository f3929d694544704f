"""Block tables of one sliding-window layer group: blocks that left the window go back.

A query at position p of a layer with window w reads keys p - w + 1 .. p. Before a sequence's
next chunk (its first query at position `c`, the tokens it has computed) is given slots, the
blocks wholly before c - w + 1 are released; their table entries become -1 (0 in the mirrored
rows the runner gathers: attention never reads a position outside its window, so what block 0
holds there does not matter)::

    window 40, block 16, c = 70: keys 31.. are still read
    table   [ -1 | -1 | 12 | 5 | 9 ]      blocks 0-1 (tokens 0..31) released
                        ^ tokens 32..47

A released block that is full and final stays cached (LRU, as in engine/kv/kv_cache.py), keyed
not by its own hash chain (its earlier blocks are gone, so the chain could not be verified)
but by the identity of group 0's cached block for the same prefix (engine/kv/hybrid.py): group
0 verifies the prefix token by token, and its block's generation changes when it is evicted,
so an entry never outlives the prefix it stands for.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvbatch.engine.kv.block_pool import BlockPool
from kvbatch.engine.kv.table_rows import MirroredTables, TableRows

DROPPED = -1  # a table entry whose block left the window


@dataclass(slots=True)
class WindowSeq:
    """One sequence's table in a window group."""

    table: list[int]  # DROPPED entries first, then held blocks
    num_tokens: int  # tokens covered by the table
    row: int
    num_dropped: int = 0  # leading entries released
    num_registered: int = 0  # leading full blocks looked at for the cache


class WindowGroup(MirroredTables):
    """One group's tables over a shared BlockPool (its blocks are any group's ids)."""

    def __init__(self, pool: BlockPool, block_size: int, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be 1 or more, got {window}")
        self.pool, self.block_size, self.window = pool, block_size, window
        self._cached: dict[tuple[int, int], int] = {}  # group 0's identity -> our block
        self._seqs: dict[Hashable, WindowSeq] = {}
        self._rows = TableRows()

    # -- lookup ---------------------------------------------------------------------------

    def first_needed(self, num_tokens: int) -> int:
        """The first block a query at position num_tokens reads."""
        return max(0, num_tokens - self.window + 1) // self.block_size

    def cached_prefix(self, identities: Sequence[tuple[int, int]]) -> tuple[int, list[int]]:
        """For a prompt whose first len(identities) blocks group 0 has cached: the most blocks
        p whose window blocks (those a query at p * block_size reads) are all cached here, and
        the table of those p blocks (DROPPED before the window)."""
        hit = [self._cached.get(key, DROPPED) for key in identities]
        last_miss = -1  # misses from the right: p is good when none is in [first_needed, p)
        misses = [i for i, b in enumerate(hit) if b == DROPPED]
        for p in range(len(hit), 0, -1):
            while misses and misses[-1] >= p:
                misses.pop()
            last_miss = misses[-1] if misses else -1
            first = self.first_needed(p * self.block_size)
            if last_miss < first:
                return p, [DROPPED] * first + hit[first:p]
        return 0, []

    # -- allocation -----------------------------------------------------------------------

    def num_blocks_to_take(
        self, seq_id: Hashable, num_new_tokens: int, computed: list[int] | None
    ) -> int:
        """Free-list blocks an allocation takes: new ones and revived cached ones, less the
        blocks that leaving the window gives back first."""
        seq = self._seqs.get(seq_id)
        bs = self.block_size
        if seq is None:
            blocks = computed or []
            have = len(blocks)
            revived = sum(1 for b in blocks if b != DROPPED and self.pool.blocks[b].ref_cnt == 0)
            need = -(-(have * bs + num_new_tokens) // bs)
            return max(0, need - have) + revived
        need = -(-(seq.num_tokens + num_new_tokens) // bs)
        released = sum(
            1
            for b in seq.table[seq.num_dropped : self.first_needed(seq.num_tokens)]
            if self.pool.blocks[b].ref_cnt == 1
        )
        return max(0, need - len(seq.table)) - released

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_new_tokens: int,
        identities: Sequence[tuple[int, int]],
        computed: list[int] | None = None,
    ) -> None:
        """Cover num_new_tokens more tokens. The caller checked the pool has the blocks and,
        for a running sequence, released what left the window first (release_out_of_window).
        `identities`: group 0's for the sequence's hashed blocks, to cache ours under."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = WindowSeq(table=[], num_tokens=0, row=self._rows.acquire())
            for b in computed or []:
                if b != DROPPED:
                    self.pool.hold(b)
                seq.table.append(b)
            seq.num_tokens = len(seq.table) * self.block_size
            seq.num_dropped = sum(1 for b in seq.table if b == DROPPED)
            seq.num_registered = len(seq.table)
            self._rows.write(seq.row, 0, [max(b, 0) for b in seq.table])
            self._seqs[seq_id] = seq
        seq.num_tokens += num_new_tokens
        first_new = len(seq.table)
        for _ in range(-(-seq.num_tokens // self.block_size) - first_new):
            seq.table.append(self.pool.take())
        if len(seq.table) > first_new:
            self._rows.write(seq.row, first_new, seq.table[first_new:])
        self._register(seq, token_ids, identities)

    def seq_state(self, seq_id: Hashable) -> WindowSeq | None:
        """seq_id's state, for the hybrid manager's per-step path (engine/kv/hybrid.py),
        which moves the counts of every group at once when no block changes hands."""
        return self._seqs.get(seq_id)

    def register(
        self, seq_id: Hashable, token_ids: Sequence[int], identities: Sequence[tuple[int, int]]
    ) -> None:
        """Cache seq_id's full, final blocks (as every allocation does)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._register(seq, token_ids, identities)

    def release_out_of_window(
        self, seq_id: Hashable, token_ids: Sequence[int], identities: Sequence[tuple[int, int]]
    ) -> None:
        """Before the sequence's next chunk: cache its final full blocks, then release those
        no query from its next position on reads (they stay cached, evicted last)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._register(seq, token_ids, identities)
            self._drop_out_of_window(seq)

    def fork(self, parent_id: Hashable, child_id: Hashable, num_blocks: int) -> None:
        """The child starts with the parent's first num_blocks entries (shared references)."""
        parent = self._seqs[parent_id]
        table = parent.table[:num_blocks]
        child = WindowSeq(
            table=table,
            num_tokens=num_blocks * self.block_size,
            row=self._rows.acquire(),
            num_dropped=min(parent.num_dropped, num_blocks),
            num_registered=min(parent.num_registered, num_blocks),
        )
        for b in table:
            if b != DROPPED:
                self.pool.blocks[b].ref_cnt += 1  # held by the parent: not in the free list
        self._rows.write(child.row, 0, [max(b, 0) for b in table])
        self._seqs[child_id] = child

    def can_fork(self, parent_id: Hashable, num_blocks: int) -> bool:
        """Whether the parent still holds every block a child of num_blocks blocks reads next."""
        parent = self._seqs.get(parent_id)
        if parent is None:
            return False
        return parent.num_dropped <= self.first_needed(num_blocks * self.block_size)

    def free(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int] | None,
        identities: Sequence[tuple[int, int]],
    ) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if token_ids is not None:
            self._register(seq, token_ids, identities)
        for b in reversed(seq.table[seq.num_dropped :]):
            self.pool.release(b)
        self._rows.release(seq.row, len(seq.table))

    def truncate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_tokens: int,
        identities: Sequence[tuple[int, int]],
    ) -> None:
        seq = self._seqs[seq_id]
        if self.first_needed(num_tokens) < seq.num_dropped:
            raise ValueError(
                f"seq {seq_id!r}: cannot truncate to {num_tokens} tokens, its window's blocks "
                f"before block {seq.num_dropped} are released"
            )
        keep = -(-num_tokens // self.block_size)
        for b in reversed(seq.table[max(keep, seq.num_dropped) :]):
            self.pool.release(b)
        self._rows.clear(seq.row, keep, len(seq.table))
        del seq.table[keep:]
        seq.num_tokens = num_tokens
        seq.num_registered = min(seq.num_registered, keep)
        self._register(seq, token_ids, identities)

    # -- internals ------------------------------------------------------------------------

    def _drop_out_of_window(self, seq: WindowSeq) -> None:
        """Release the blocks no query from position seq.num_tokens on reads."""
        first = min(self.first_needed(seq.num_tokens), len(seq.table))
        if first <= seq.num_dropped:
            return
        for i in range(first - 1, seq.num_dropped - 1, -1):  # tail first, as free does
            self.pool.release(seq.table[i])
            seq.table[i] = DROPPED
        self._rows.clear(seq.row, seq.num_dropped, first)
        seq.num_dropped = first

    def _register(
        self, seq: WindowSeq, token_ids: Sequence[int], identities: Sequence[tuple[int, int]]
    ) -> None:
        """Cache the seq's full, final blocks under group 0's identities for their prefixes."""
        num_full = min(seq.num_tokens, len(token_ids)) // self.block_size
        end = min(num_full, len(identities))
        for i in range(seq.num_registered, end):
            b = seq.table[i]
            key = identities[i]
            if b == DROPPED or key in self._cached:
                continue  # released unseen, or a twin is cached already: ours stays private
            block = self.pool.blocks[b]
            if block.hash is not None:
                continue  # already cached (shared with a fork)
            block.hash, block.cache_map = key, self._cached
            self._cached[key] = b
        seq.num_registered = max(seq.num_registered, end)

    # -- queries --------------------------------------------------------------------------

    def block_table(self, seq_id: Hashable) -> list[int]:
        seq = self._seqs.get(seq_id)
        return list(seq.table) if seq else []

    def num_dropped(self, seq_id: Hashable) -> int:
        """Leading blocks of seq_id's table already released (0 for an unknown one)."""
        seq = self._seqs.get(seq_id)
        return seq.num_dropped if seq else 0

    def num_held(self, seq_id: Hashable) -> int:
        seq = self._seqs.get(seq_id)
        return len(seq.table) - seq.num_dropped if seq else 0

    def refs(self) -> list[int]:
        """References this group holds to each block of the pool."""
        refs = [0] * self.pool.num_blocks
        for seq in self._seqs.values():
            for b in seq.table[seq.num_dropped :]:
                refs[b] += 1
        return refs

    def check_integrity(self) -> None:
        for seq_id, seq in self._seqs.items():
            held = seq.table[seq.num_dropped :]
            if DROPPED in held or any(b != DROPPED for b in seq.table[: seq.num_dropped]):
                raise RuntimeError(f"window seq {seq_id!r}: dropped entries out of place")
            if len(seq.table) != -(-seq.num_tokens // self.block_size):
                raise RuntimeError(
                    f"window seq {seq_id!r}: {len(seq.table)} blocks for {seq.num_tokens} tokens"
                )
            if len(set(held)) != len(held):
                raise RuntimeError(f"window seq {seq_id!r} holds a block twice: {held}")
            row = self._rows.array[seq.row]
            if (
                row[: len(seq.table)].tolist() != [max(b, 0) for b in seq.table]
                or row[len(seq.table) :].any()
            ):
                raise RuntimeError(f"window seq {seq_id!r}: its mirrored table row differs")
        for key, b in self._cached.items():
            block = self.pool.blocks[b]
            if block.hash != key or block.cache_map is not self._cached:
                raise RuntimeError(f"window map entry {key} -> block {b} disagrees")

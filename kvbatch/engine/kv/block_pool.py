"""Physical KV block ids: each block's reference count and cache registration, and the LRU
free list that hands them out (engine/kv/kv_cache.py decides which sequence holds which).

Freed blocks keep their registration and wait in the free list (an intrusive doubly linked
list: O(1) push, pop and removal from the middle when a cache hit revives a block). Blocks
that may be hit again join the tail and are evicted last; blocks without a registration join
the head and are reused first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator


class Block:
    __slots__ = ("block_id", "cache_map", "gen", "hash", "parent", "ref_cnt", "tokens")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hash: Hashable | None = None  # set iff the block is in a hash map: cache_map
        self.cache_map: dict | None = None  # that map (a pool serves several groups' maps)
        self.tokens: tuple[int, ...] | None = None  # contents, checked on every hit
        self.parent: tuple[int, int] | None = None  # (block_id, gen) of the parent block
        self.gen = 0  # bumped whenever the block loses its registration


class _FreeBlockQueue:
    """Block ids in a doubly linked list threaded through two arrays (head = evicted first).

    Index ``n`` is a sentinel closing the ring; ``prev[b] == -1`` means b is not in the list.
    """

    def __init__(self, num_blocks: int) -> None:
        s = num_blocks
        self._s = s
        self._prev = [s, *range(num_blocks)]  # prev[0] = s, prev[b] = b - 1, prev[s] = last
        self._next = [*range(1, num_blocks + 1), 0]  # next[last] = s, next[s] = 0
        self._prev[s] = s - 1 if num_blocks else s
        self._next[s] = 0 if num_blocks else s
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

    def __contains__(self, b: int) -> bool:
        return self._prev[b] != -1

    def __iter__(self) -> Iterator[int]:
        b = self._next[self._s]
        for _ in range(self._len):  # bounded, so a corrupt ring cannot loop forever
            if b == self._s:
                return
            yield b
            b = self._next[b]

    def _link(self, b: int, before: int) -> None:
        p = self._prev[before]
        self._prev[b], self._next[b] = p, before
        self._next[p] = b
        self._prev[before] = b
        self._len += 1

    def push_head(self, b: int) -> None:
        self._link(b, self._next[self._s])

    def push_tail(self, b: int) -> None:
        self._link(b, self._s)

    def remove(self, b: int) -> None:
        p, n = self._prev[b], self._next[b]
        self._next[p] = n
        self._prev[n] = p
        self._prev[b] = self._next[b] = -1
        self._len -= 1

    def pop_head(self) -> int:
        b = self._next[self._s]
        if b == self._s:
            raise RuntimeError("free list is empty")
        self.remove(b)
        return b

    def check(self, num_blocks: int) -> list[int]:
        """Walk the ring, raising RuntimeError on a broken link; returns the ids head to tail."""
        seen: list[int] = []
        b, prev = self._next[self._s], self._s
        while b != self._s:
            if not 0 <= b < num_blocks:
                raise RuntimeError(f"free list holds invalid block id {b}")
            if self._prev[b] != prev:
                raise RuntimeError(f"free list: prev[{b}] = {self._prev[b]}, expected {prev}")
            seen.append(b)
            if len(seen) > num_blocks:
                raise RuntimeError("free list has a cycle")
            prev, b = b, self._next[b]
        if self._prev[self._s] != prev:
            raise RuntimeError("free list: sentinel's prev is not the last block")
        if len(seen) != self._len:
            raise RuntimeError(f"free list length {self._len} but {len(seen)} blocks linked")
        return seen


class BlockPool:
    """Physical block ids with their reference counts and the LRU free list. One manager owns
    a pool; window groups (engine/kv/window_group.py) draw from the same one, so blocks go
    wherever the running sequences need them. Evicting a cached block removes it from
    whichever group's map holds it (`Block.cache_map`)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free = _FreeBlockQueue(num_blocks)

    def take(self) -> int:
        """A free block, referenced once: the least recently freed, its cache entry evicted."""
        b = self.free.pop_head()
        block = self.blocks[b]
        if block.hash is not None:
            uncache(block)
        block.ref_cnt = 1
        return b

    def hold(self, b: int) -> None:
        """One more reference to block b (a cache hit revives it from the free list)."""
        block = self.blocks[b]
        if block.ref_cnt == 0:
            self.free.remove(b)  # O(1): revive a cached block from the LRU list
        block.ref_cnt += 1

    def release(self, b: int) -> None:
        block = self.blocks[b]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.hash is not None:
                self.free.push_tail(b)  # may be hit again: evict last
            else:
                self.free.push_head(b)  # nobody can hit it: reuse first


def uncache(block: Block) -> None:
    """Remove the block from its group's hash map; its generation moves on, so whatever named
    it (a child block, a window group's entry) can no longer be reached through it."""
    del block.cache_map[block.hash]  # type: ignore[index]
    block.hash = block.tokens = block.parent = block.cache_map = None
    block.gen += 1

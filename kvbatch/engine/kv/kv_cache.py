"""Paged KV-cache block accounting: which physical block holds which tokens.

The KV tensors live in the runner (``[num_blocks, block_size, ...]`` per layer); this module
only hands out block ids. A sequence's block table maps its logical blocks to physical ones,
and token ``t`` of a sequence lives in slot ``table[t // block_size] * block_size +
t % block_size``.

Full blocks are content-addressed so that sequences sharing a prefix share its KV::

    seq A tokens:  | sys[0:16] | sys[16:32] | doc[0:16] | q[0:5]     |
    seq A table:   [     7     ,     2      ,     9     ,   5        ]   5: partly filled, private
    seq B table:   [     7     ,     2      ,     9     ,   3        ]   B: same sys + doc
    seq C table:   [     7     ,     2      ,     4     ]              C: same sys, other doc

    physical:      0  1  2  3  4  5  6  7  8  9
    ref counts:          3  1  1  1     3     2

    chained hashes (only full blocks are hashed):
      h0 = H(None, sys[0:16])   h1 = H(h0, sys[16:32])   h2 = H(h1, doc[0:16])
    hash map: {h0: 7, h1: 2, h2: 9, H(h1, C's block): 4}

A hash alone can collide (and ``hash_fn`` is injectable), so a lookup never trusts it: every
registered block keeps its own tokens and the identity ``(block_id, generation)`` of its
parent block, and a hit is verified block by block from the first one. A block's generation
changes whenever it loses its registration (evicted, or displaced as stale), so a child that
names an evicted parent can never be reached again.

Freed blocks keep their hash and wait in an LRU free list (an intrusive doubly linked list:
O(1) push, pop and removal from the middle when a cache hit revives a block). Sequences are
freed tail first and hashed blocks join the tail, so the ends of prefixes are evicted before
their shared beginnings; blocks without a hash join the head and are reused first.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvbatch.engine.kv.block_pool import Block, BlockPool, uncache
from kvbatch.engine.kv.table_rows import MirroredTables, TableRows

HashFn = Callable[[int | None, tuple[int, ...]], int]

# Stand-in for "no parent" in the default hash: hash(None) is id-based before Python 3.12,
# so it would differ between processes and the jobs layer hashes prompts in another process.
_ROOT = 0x9E3779B97F4A7C15


def default_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Chained block hash: Python's tuple hash, deterministic across processes for ints."""
    return hash((_ROOT if parent is None else parent, tokens))


def block_hashes(
    token_ids: Sequence[int], block_size: int, hash_fn: HashFn | None = None
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (the partial last block is skipped)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    fn = hash_fn or default_hash
    hashes: list[int] = []
    h: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = fn(h, tuple(token_ids[start : start + block_size]))
        hashes.append(h)
    return hashes


class ComputedBlocks(NamedTuple):
    """Cached blocks covering the longest cached prefix of a prompt."""

    block_ids: list[int]  # in order, first block first
    num_tokens: int  # == len(block_ids) * block_size
    # With window groups (engine/kv/hybrid.py): each window group's cached blocks of the same
    # prefix, -1 where a block has left the window (it is never read again).
    window_block_ids: tuple[list[int], ...] = ()


@dataclass
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    usage: float  # fraction of blocks referenced by some sequence
    prefix_queries: int  # prompt tokens looked up
    prefix_hits: int  # of those, tokens served from the cache

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(slots=True)
class _SeqState:
    table: list[int]
    num_tokens: int  # tokens covered by the table (allocated)
    num_hashed: int = 0  # leading full blocks already run through the hash chain
    last_hash: int | None = None  # chain hash of block num_hashed - 1
    parent: tuple[int, int] | None = None  # identity of the cached block for that prefix
    chain_broken: bool = False  # a true collision: later blocks cannot be shared
    row: int = 0  # its row in KVCacheManager._rows (engine/kv/table_rows.py)
    # (block id, generation) of the cached block standing for each of its first num_hashed
    # blocks' prefix: what window groups key their cached blocks by (engine/kv/hybrid.py)
    ids: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager(MirroredTables):
    """Block tables, reference counts, prefix cache and LRU free list for one KV pool."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
        pool: BlockPool | None = None,  # shared with window groups (engine/kv/hybrid.py)
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool or BlockPool(num_blocks)
        self.num_blocks = self.pool.num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn or default_hash
        self._blocks = self.pool.blocks
        self._free = self.pool.free
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self._seqs: dict[Hashable, _SeqState] = {}
        self._rows = TableRows()  # the tables mirrored in one array (table_array)
        self._prefix_queries = 0
        self._prefix_hits = 0

    # -- lookup ---------------------------------------------------------------------------

    def get_computed_blocks(self, token_ids: Sequence[int]) -> ComputedBlocks:
        """Longest cached prefix of full blocks, leaving at least the last token to compute.

        Takes no references: pass the result to allocate_slots right away. The query and its hits
        are counted in the statistics when allocate_slots starts the sequence.
        """
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0)
        bs = self.block_size
        block_ids: list[int] = []
        h: int | None = None
        parent: tuple[int, int] | None = None
        # The last prompt token is always computed: its logits give the first output token.
        for i in range(max(0, len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._hash_fn(h, tokens)
            b = self._cached.get(h)
            if b is None:
                break
            block = self._blocks[b]
            if block.tokens != tokens or block.parent != parent:
                break  # hash collision: contents or prefix differ
            block_ids.append(b)
            parent = (b, block.gen)
        return ComputedBlocks(block_ids, len(block_ids) * bs)

    # -- allocation -----------------------------------------------------------------------

    def can_allocate(
        self, seq_id: Hashable, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Whether allocate_slots with the same arguments would succeed."""
        return self.num_blocks_to_take(seq_id, num_new_tokens, computed) <= len(self._free)

    def allocate_slots(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> bool:
        """Grow seq_id's table to cover num_new_tokens more tokens; False (no change) if full.

        ``computed`` (first call only) starts the table with cached blocks. ``token_ids`` is
        the sequence's token list; blocks completely filled by its first covered tokens are
        registered in the prefix cache. Pass only final tokens: unverified draft tokens beyond
        ``len(token_ids)`` get slots but their blocks are not hashed until a later call.
        """
        seq = self._seqs.get(seq_id)
        if seq is not None and computed is None and 0 <= num_new_tokens:
            total = seq.num_tokens + num_new_tokens
            if total <= len(seq.table) * self.block_size:  # a decode, most steps: no new block
                seq.num_tokens = total
                full = min(total, len(token_ids)) // self.block_size
                if self.enable_prefix_caching and full > seq.num_hashed:
                    self._register_full_blocks(seq, token_ids)
                return True
        if self.num_blocks_to_take(seq_id, num_new_tokens, computed) > len(self._free):
            return False
        if seq is None:
            seq = self._start_seq(seq_id, token_ids, computed)
        seq.num_tokens += num_new_tokens
        first_new = len(seq.table)
        for _ in range(-(-seq.num_tokens // self.block_size) - first_new):
            seq.table.append(self.pool.take())  # evicts the least recently freed cached block
        if len(seq.table) > first_new:
            self._rows.write(seq.row, first_new, seq.table[first_new:])
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, token_ids)
        return True

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> int:
        """Start child_id's table with the parent's blocks holding its first num_tokens tokens.

        For n > 1 choices of one prompt: the children reference (ref_cnt + 1) the parent's
        *full* blocks among those tokens instead of recomputing them; a partly filled block is
        never shared, since the parent keeps writing into it, so the child computes those last
        tokens itself into blocks of its own (allocate_slots, as for any sequence)::

            prompt of 37 tokens, block_size 16, num_tokens 37
            parent: [ 4 | 9 | 6 ]    6 holds tokens 32..36, then the parent's outputs
            child:  [ 4 | 9 ]        ref_cnt 2 each; the child computes 32..36 next

        Returns the tokens shared (a multiple of block_size; 0 when the parent holds no full
        block of them). The parent must have computed the KV of those tokens.
        """
        if child_id in self._seqs:
            raise ValueError(f"seq {child_id!r} already has blocks; fork starts a new one")
        parent = self._seqs.get(parent_id)
        if parent is None or num_tokens < 0:
            return 0
        k = min(num_tokens, parent.num_tokens) // self.block_size
        if k == 0:
            return 0
        child = _SeqState(table=parent.table[:k], num_tokens=k * self.block_size)
        child.ids = parent.ids[: min(k, parent.num_hashed)]
        child.row = self._rows.acquire()
        for b in child.table:
            self._blocks[b].ref_cnt += 1  # held by the parent: never in the free list
        self._rows.write(child.row, 0, child.table)
        self._fork_hash_chain(parent, child, k)
        self._seqs[child_id] = child
        return child.num_tokens

    def _fork_hash_chain(self, parent: _SeqState, child: _SeqState, k: int) -> None:
        """Give a child of k shared blocks the parent's hash chain at block k, so its own
        blocks after them can be cached; where that point of the chain is unknown (the
        parent's block k - 1 is a private twin of a cached one) the child's later blocks
        simply stay private."""
        if parent.num_hashed <= k:  # the child hashes the rest itself, as the parent would
            child.num_hashed, child.last_hash = parent.num_hashed, parent.last_hash
            child.parent, child.chain_broken = parent.parent, parent.chain_broken
            return
        last = self._blocks[child.table[k - 1]]
        child.num_hashed = k
        if last.hash is None or parent.chain_broken:
            child.chain_broken = True
            return
        child.last_hash, child.parent = last.hash, (last.block_id, last.gen)

    def free(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> None:
        """Release seq_id's blocks, tail first (unknown ids are ignored).

        ``token_ids``: the sequence's tokens now, when more are known than at its last
        allocation (with async scheduling a token arrives a step after its slot was given):
        blocks they fill are registered in the prefix cache before the release.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        if token_ids is not None and self.enable_prefix_caching:
            self._register_full_blocks(seq, token_ids)
        for b in reversed(seq.table):
            self._release(b)
        self._rows.release(seq.row, len(seq.table))

    def register(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Cache seq_id's blocks that token_ids now fill (as allocate_slots and free do)."""
        seq = self._seqs.get(seq_id)
        if seq is not None and self.enable_prefix_caching:
            if min(seq.num_tokens, len(token_ids)) // self.block_size > seq.num_hashed:
                self._register_full_blocks(seq, token_ids)

    def truncate(self, seq_id: Hashable, token_ids: Sequence[int], num_tokens: int) -> None:
        """Shrink seq_id's table to its first num_tokens tokens (speculative rollback).

        The slots of rejected draft tokens go back: blocks wholly past the new end return to
        the pool, and a partly kept block is simply overwritten later. ``token_ids`` are the
        sequence's final tokens; blocks that the accepted tokens filled are registered in the
        prefix cache now. Drafts never reach it: a block is hashed only when every token in it
        is both final (in ``token_ids``) and covered by the table.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"seq {seq_id!r} has no blocks to truncate")
        if not seq.num_hashed * self.block_size <= num_tokens <= seq.num_tokens:
            raise ValueError(
                f"seq {seq_id!r}: cannot truncate {seq.num_tokens} tokens to {num_tokens} "
                f"(its first {seq.num_hashed * self.block_size} are final and cached)"
            )
        keep = -(-num_tokens // self.block_size)
        for b in reversed(seq.table[keep:]):
            self._release(b)
        self._rows.clear(seq.row, keep, len(seq.table))
        del seq.table[keep:]
        seq.num_tokens = num_tokens
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, token_ids)

    def _release(self, b: int) -> None:
        self.pool.release(b)

    # -- queries --------------------------------------------------------------------------

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of seq_id's block table (empty for an unknown sequence)."""
        seq = self._seqs.get(seq_id)
        return list(seq.table) if seq else []

    def fits_last_block(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether seq_id's table already covers num_new_tokens more tokens (no new block)."""
        seq = self._seqs.get(seq_id)
        return (
            seq is not None
            and 0 <= num_new_tokens
            and seq.num_tokens + num_new_tokens <= len(seq.table) * self.block_size
        )

    def identities(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """(block id, generation) of the cached block standing for each of seq_id's hashed
        blocks' prefix, first block first (the list itself: do not change it)."""
        seq = self._seqs.get(seq_id)
        return seq.ids if seq else []

    def identity_of(self, b: int) -> tuple[int, int]:
        """The identity window groups key block b's prefix by (b must be cached)."""
        return (b, self._blocks[b].gen)

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Tokens covered by seq_id's table so far (cached + allocated)."""
        seq = self._seqs.get(seq_id)
        return seq.num_tokens if seq else 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def stats(self) -> KVCacheStats:
        free = len(self._free)
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=free,
            usage=(self.num_blocks - free) / self.num_blocks,
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
        )

    def check_integrity(self, other_refs: list[int] | None = None) -> None:
        """Verify every invariant; raises RuntimeError naming the first violation.
        `other_refs`: references to each block held by the window groups sharing the pool."""
        free_ids = self._free.check(self.num_blocks)
        in_free = [False] * self.num_blocks
        for b in free_ids:
            if in_free[b]:
                raise RuntimeError(f"block {b} is in the free list twice")
            in_free[b] = True
        refs = list(other_refs) if other_refs is not None else [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            if len(set(seq.table)) != len(seq.table):
                raise RuntimeError(f"seq {seq_id!r} holds a block twice: {seq.table}")
            if len(seq.table) != -(-seq.num_tokens // self.block_size):
                raise RuntimeError(
                    f"seq {seq_id!r}: {len(seq.table)} blocks for {seq.num_tokens} tokens"
                )
            for b in seq.table:
                if not 0 <= b < self.num_blocks:
                    raise RuntimeError(f"seq {seq_id!r} holds invalid block id {b}")
                refs[b] += 1
            row = self._rows.array[seq.row]
            if row[: len(seq.table)].tolist() != seq.table or row[len(seq.table) :].any():
                raise RuntimeError(f"seq {seq_id!r}: its mirrored table row differs")
        rows = [seq.row for seq in self._seqs.values()]
        if 0 in rows or len(set(rows)) != len(rows) or set(rows) & set(self._rows.free_rows):
            raise RuntimeError(f"table rows are shared or also free: {sorted(rows)}")
        for block in self._blocks:
            b = block.block_id
            if block.ref_cnt != refs[b]:
                raise RuntimeError(f"block {b}: ref_cnt {block.ref_cnt}, held by {refs[b]} tables")
            if (block.ref_cnt == 0) != in_free[b]:
                state = "in" if in_free[b] else "not in"
                raise RuntimeError(f"block {b}: ref_cnt {block.ref_cnt} but {state} free list")
            if block.hash is not None and block.cache_map is not self._cached:
                continue  # a window group's block: the group checks its own map
            if block.hash is not None and self._cached.get(block.hash) != b:
                raise RuntimeError(f"block {b} has hash {block.hash} but the map disagrees")
            if block.hash is not None and (
                block.tokens is None or len(block.tokens) != self.block_size
            ):
                raise RuntimeError(f"cached block {b} does not hold a full block of tokens")
        for h, b in self._cached.items():
            if self._blocks[b].hash != h:
                raise RuntimeError(
                    f"hash map entry {h} -> block {b} with hash {self._blocks[b].hash}"
                )
        if not self.enable_prefix_caching and self._cached:
            raise RuntimeError("prefix caching is off but blocks are cached")
        num_used = sum(1 for r in refs if r)
        if num_used + len(free_ids) != self.num_blocks:
            raise RuntimeError(f"{num_used} used + {len(free_ids)} free != {self.num_blocks}")

    def num_blocks_to_take(
        self, seq_id: Hashable, num_new_tokens: int, computed: ComputedBlocks | None
    ) -> int:
        """Free-list blocks an allocation needs: fresh ones plus revived cached ones (the
        hybrid manager adds the window groups' to it, engine/kv/hybrid.py)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._seqs.get(seq_id)
        if seq is not None:
            if computed is not None and computed.block_ids:
                raise ValueError(f"seq {seq_id!r} already has blocks; computed is for a new seq")
            have, covered = len(seq.table), seq.num_tokens
            revived = 0
        elif computed is not None:
            if computed.num_tokens != len(computed.block_ids) * self.block_size:
                raise ValueError("computed.num_tokens must be len(block_ids) * block_size")
            have, covered = len(computed.block_ids), computed.num_tokens
            revived = sum(1 for b in computed.block_ids if self._blocks[b].ref_cnt == 0)
        else:
            have = covered = revived = 0
        need = -(-(covered + num_new_tokens) // self.block_size)
        return max(0, need - have) + revived

    # -- internals ------------------------------------------------------------------------

    def _start_seq(
        self, seq_id: Hashable, token_ids: Sequence[int], computed: ComputedBlocks | None
    ) -> _SeqState:
        seq = _SeqState(table=[], num_tokens=0, row=self._rows.acquire())
        if self.enable_prefix_caching:
            # Counted when a sequence starts, not per lookup: a request that waits for blocks
            # looks up its prefix every step but is admitted (and counted) once.
            self._prefix_queries += len(token_ids)
            self._prefix_hits += computed.num_tokens if computed is not None else 0
        if computed is not None and computed.block_ids:
            self._check_computed(token_ids, computed)
            for b in computed.block_ids:
                self.pool.hold(b)
                seq.table.append(b)
                seq.ids.append((b, self._blocks[b].gen))
            self._rows.write(seq.row, 0, seq.table)
            last = self._blocks[computed.block_ids[-1]]
            seq.num_tokens = computed.num_tokens
            seq.num_hashed = len(computed.block_ids)
            seq.last_hash = last.hash
            seq.parent = (last.block_id, last.gen)
        self._seqs[seq_id] = seq
        return seq

    def _check_computed(self, token_ids: Sequence[int], computed: ComputedBlocks) -> None:
        """Reject blocks evicted or re-registered since get_computed_blocks returned them."""
        bs = self.block_size
        parent: tuple[int, int] | None = None
        for i, b in enumerate(computed.block_ids):
            block = self._blocks[b]
            if (
                block.hash is None
                or block.parent != parent
                or block.tokens != tuple(token_ids[i * bs : (i + 1) * bs])
            ):
                raise ValueError(
                    "computed blocks are stale: call get_computed_blocks right before "
                    "allocate_slots, with no allocation in between"
                )
            parent = (b, block.gen)

    def _register_full_blocks(self, seq: _SeqState, token_ids: Sequence[int]) -> None:
        """Hash and register the seq's newly filled blocks, continuing its hash chain."""
        bs = self.block_size
        num_full = min(seq.num_tokens, len(token_ids)) // bs
        while seq.num_hashed < num_full and not seq.chain_broken:
            if seq.parent is not None and self._blocks[seq.parent[0]].gen != seq.parent[1]:
                # The cached block standing for our prefix (a twin we do not hold) was evicted:
                # anything registered under it now would be unreachable.
                seq.chain_broken = True
                return
            i = seq.num_hashed
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._hash_fn(seq.last_hash, tokens)
            b = self._cached.get(h)
            if b is not None and self._is_stale(self._blocks[b]):
                self._uncache(self._blocks[b])  # unreachable entry: make room
                b = None
            if b is None:
                block = self._blocks[seq.table[i]]
                block.hash, block.tokens, block.parent = h, tokens, seq.parent
                block.cache_map = self._cached
                self._cached[h] = block.block_id
            else:
                block = self._blocks[b]
                if block.tokens != tokens or block.parent != seq.parent:
                    # True collision: keep the existing entry; this block stays private, and
                    # so do the later ones, since no lookup can get past this position.
                    seq.chain_broken = True
                    return
                # Same contents computed twice (e.g. two prefills racing): ours stays private,
                # and the seq's later blocks chain onto the cached twin so they can be shared.
            seq.parent = (block.block_id, block.gen)
            seq.ids.append(seq.parent)
            seq.last_hash = h
            seq.num_hashed += 1

    def _is_stale(self, block: Block) -> bool:
        """A cached block whose parent has since been evicted can never be reached."""
        p = block.parent
        return p is not None and self._blocks[p[0]].gen != p[1]

    def _uncache(self, block: Block) -> None:
        uncache(block)

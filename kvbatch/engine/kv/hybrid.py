"""The KV manager of a model with sliding-window layers: group 0's tables plus one per window
group (engine/kv/layout.py), behind KVCacheManager's interface, so the scheduler and the n > 1
choices run unchanged.

- Group 0 (full attention) is a KVCacheManager: its hash chain verifies every prefix token by
  token. The window groups draw blocks from the same pool (engine/kv/window_group.py).
- A model with no full-attention layer keeps group 0 for the identities alone: a manager over a
  pool of its own, with no KV behind its ids, sized so it never runs out before the real pool.
- A prefix hit must hold, in every group, the blocks its first query reads: group 0 all of
  them, a window group those of its last window. The hit is group 0's longest cached prefix cut
  back until every window group has its blocks (window_group.cached_prefix).
- An allocation happens in every group or in none: the blocks each would take (less those its
  window gives back) are counted against the pool before any group changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvbatch.engine.kv.block_pool import BlockPool
from kvbatch.engine.kv.kv_cache import (
    ComputedBlocks,
    HashFn,
    KVCacheManager,
    KVCacheStats,
)
from kvbatch.engine.kv.layout import KVLayout
from kvbatch.engine.kv.window_group import WindowGroup, WindowSeq


class HybridKVCacheManager:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn | None = None,
        num_identity_blocks: int = 0,  # group 0's ids when it has no layers (no KV)
    ) -> None:
        if not layout.is_hybrid:
            raise ValueError("a layout without window groups takes a KVCacheManager")
        self.layout = layout
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.full_has_kv = bool(layout.groups[0].layers)
        self.full = KVCacheManager(
            num_identity_blocks or num_blocks,
            block_size,
            enable_prefix_caching,
            hash_fn,
            pool=self.pool if self.full_has_kv else None,
        )
        if not self.full_has_kv and num_identity_blocks < 1:
            raise ValueError("a group 0 without layers needs num_identity_blocks")
        self.windows = [WindowGroup(self.pool, block_size, g.window) for g in layout.groups[1:]]
        sizes = {w.window: i for i, w in reversed(list(enumerate(self.windows)))}
        self._first_of_each_window = [(i, window) for window, i in sizes.items()]
        self._states: dict[Hashable, list[WindowSeq]] = {}  # a sequence's state in each group

    @property
    def tables(self) -> list:
        """Each group's tables, in layout order, for the groups with layers (the runner's)."""
        return ([self.full] if self.full_has_kv else []) + list(self.windows)

    # -- lookup ---------------------------------------------------------------------------

    def get_computed_blocks(self, token_ids: Sequence[int]) -> ComputedBlocks:
        full = self.full.get_computed_blocks(token_ids)
        if not full.block_ids:
            return full
        identities = [self.full.identity_of(b) for b in full.block_ids]
        # A length one group accepts, another may cut; and a shorter one needs earlier blocks
        # the first group may lack: go round until every group takes the same length.
        p, settled = len(identities), False
        while not settled:
            found = [w.cached_prefix(identities[:p]) for w in self.windows]
            settled = all(q == p for q, _ in found)
            p = min(q for q, _ in found)
        windows = tuple(table for _, table in found)
        return ComputedBlocks(full.block_ids[:p], p * self.block_size, windows)

    # -- allocation -----------------------------------------------------------------------

    def _fits(self, seq_id: Hashable, n: int, computed: ComputedBlocks | None) -> bool:
        full = self.full.num_blocks_to_take(seq_id, n, computed)
        windows = computed.window_block_ids if computed is not None else ()
        take = sum(
            w.num_blocks_to_take(seq_id, n, windows[i] if windows else None)
            for i, w in enumerate(self.windows)
        )
        if self.full_has_kv:
            return full + take <= len(self.pool.free)
        return full <= self.full.num_free_blocks and take <= len(self.pool.free)

    def can_allocate(
        self, seq_id: Hashable, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        return self._fits(seq_id, num_new_tokens, computed)

    def allocate_slots(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
    ) -> bool:
        if computed is None and self._within_last_blocks(seq_id, token_ids, num_new_tokens):
            return True
        if not self._fits(seq_id, num_new_tokens, computed):
            return False
        windows = computed.window_block_ids if computed is not None else ()
        if self.enable_prefix_caching:  # identities for the blocks the windows release now
            self.full.register(seq_id, token_ids)
        identities = self.full.identities(seq_id)
        for w in self.windows:  # first: what they give back is what the fit counted on
            w.release_out_of_window(seq_id, token_ids, identities)
        if not self.full.allocate_slots(seq_id, token_ids, num_new_tokens, computed):
            raise RuntimeError("group 0 refused an allocation the pool had room for")
        identities = self.full.identities(seq_id)
        for i, w in enumerate(self.windows):
            w.allocate(
                seq_id, token_ids, num_new_tokens, identities, windows[i] if windows else None
            )
        self._track(seq_id)
        return True

    def _within_last_blocks(
        self, seq_id: Hashable, token_ids: Sequence[int], num_new_tokens: int
    ) -> bool:
        """Most decode steps: the new tokens fit every group's last block (the groups' tables
        are equally long) and no block leaves a window, so only counts move, every group's
        at once. Groups of one window size release together: the first of each size answers
        for all of them."""
        states = self._states.get(seq_id)
        if states is None or not self.full.fits_last_block(seq_id, num_new_tokens):
            return False
        old, bs = states[0].num_tokens, self.block_size
        for i, window in self._first_of_each_window:
            if max(0, old - window + 1) // bs > states[i].num_dropped:
                return False
        self.full.allocate_slots(seq_id, token_ids, num_new_tokens)
        for state in states:
            state.num_tokens += num_new_tokens
        filled = min(old + num_new_tokens, len(token_ids)) // bs > states[0].num_registered
        if filled and self.enable_prefix_caching:
            identities = self.full.identities(seq_id)
            for w in self.windows:
                w.register(seq_id, token_ids, identities)
        return True

    def _track(self, seq_id: Hashable) -> None:
        """Keep seq_id's window states at hand for _within_last_blocks."""
        if seq_id not in self._states:
            self._states[seq_id] = [w.seq_state(seq_id) for w in self.windows]

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> int:
        """As KVCacheManager.fork; no sharing at all when a window group has already released
        a block the child would read next."""
        k = min(num_tokens, self.full.num_computed_tokens(parent_id)) // self.block_size
        if k == 0 or not all(w.can_fork(parent_id, k) for w in self.windows):
            return 0
        shared = self.full.fork(parent_id, child_id, k * self.block_size)
        for w in self.windows:
            w.fork(parent_id, child_id, shared // self.block_size)
        self._track(child_id)
        return shared

    def free(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> None:
        if token_ids is not None and self.enable_prefix_caching:
            # group 0 registers first: its identities key the window groups' blocks
            self.full.register(seq_id, token_ids)
        identities = self.full.identities(seq_id)
        for w in self.windows:
            w.free(seq_id, token_ids if self.enable_prefix_caching else None, identities)
        self.full.free(seq_id)
        self._states.pop(seq_id, None)

    def truncate(self, seq_id: Hashable, token_ids: Sequence[int], num_tokens: int) -> None:
        self.full.truncate(seq_id, token_ids, num_tokens)
        identities = self.full.identities(seq_id)
        for w in self.windows:
            w.truncate(seq_id, token_ids, num_tokens, identities)

    # -- queries --------------------------------------------------------------------------

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Group 0's table (see `group_tables` for every group's)."""
        return self.full.block_table(seq_id)

    def group_tables(self, seq_id: Hashable) -> list[list[int]]:
        return [self.full.block_table(seq_id)] + [w.block_table(seq_id) for w in self.windows]

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        return self.full.num_computed_tokens(seq_id)

    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free)

    def stats(self) -> KVCacheStats:
        full = self.full.stats()  # prefix queries and hits: the hits every group had
        free = len(self.pool.free)
        return KVCacheStats(
            num_blocks=self.num_blocks,
            num_free_blocks=free,
            usage=(self.num_blocks - free) / self.num_blocks,
            prefix_queries=full.prefix_queries,
            prefix_hits=full.prefix_hits,
        )

    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        for w in self.windows:
            w.check_integrity()
            for b, r in enumerate(w.refs()):
                refs[b] += r
        if self.full_has_kv:
            self.full.check_integrity(other_refs=refs)
            return
        self.full.check_integrity()
        used = sum(1 for r in refs if r)
        free = self.pool.free.check(self.num_blocks)
        for b in free:
            if refs[b]:
                raise RuntimeError(f"block {b} is free but held by a window table")
        for block in self.pool.blocks:
            if block.ref_cnt != refs[block.block_id]:
                raise RuntimeError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, held "
                    f"{refs[block.block_id]} times"
                )
        if used + len(free) != self.num_blocks:
            raise RuntimeError(f"{used} used + {len(free)} free != {self.num_blocks}")


def kv_manager_for(
    layout: KVLayout,
    num_blocks: int,
    block_size: int,
    enable_prefix_caching: bool,
    max_model_len: int,
    max_num_seqs: int,
) -> KVCacheManager | HybridKVCacheManager:
    """The engine's KV manager: one table without window groups, else the hybrid one. When
    every layer has a window, group 0 only names prefixes, from ids of its own: enough for
    every running request's whole context beside what the pool keeps cached (a running
    request holds at least a block in each window group)."""
    if not layout.is_hybrid:
        return KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    per_seq = -(-max_model_len // block_size)
    running = max(1, min(max_num_seqs, num_blocks // len(layout.groups)))
    identities = 0 if layout.groups[0].layers else num_blocks + running * per_seq
    return HybridKVCacheManager(
        layout, num_blocks, block_size, enable_prefix_caching, num_identity_blocks=identities
    )

"""Which layers share a block table, and which KV tensor each layer's blocks live in.

A sliding-window layer only ever reads its last `window` keys, so its blocks can go back to the
pool once every query still to come is past them; a full-attention layer keeps them all. Layers
are therefore grouped by window (as vLLM's and SGLang's hybrid KV managers do): one block table
per group and sequence. Every group has the same number of layers (`num_slots`; the last group
of a kind may have fewer, its slots padding), and the pool holds `num_slots` KV tensors: slot j
of block b is layer j of whichever group holds b. One pool of block ids then serves every group,
so blocks go where the running sequences need them, with no split decided in advance:

    Gemma 3 (6 layers: 5 local with window 512, 1 global)   num_slots = 1
        group 0  full      layers (5,)       table  [7 2 9 4 8 ...]  one block per 16 tokens
        group 1  window    layers (0,)       table  [- - 3 6 1]      the last 512 tokens only
        ...
        group 5  window    layers (4,)

Group 0 is always the full-attention group. A model whose every layer has a window (Mistral's,
Phi-3-4k) has a group 0 with no layers: its table holds no KV and only gives each prefix block
the identity the window groups key their cached blocks by (engine/kv/hybrid.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # keys each query reads (itself included); None: every key
    layers: tuple[int, ...]  # the model's layers in slot order (fewer than num_slots: padding)

    @property
    def label(self) -> str:
        return "full attention" if self.window is None else f"window {self.window}"

    def blocks_per_seq(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks one sequence of num_tokens tokens holds at most: all of them, or for a
        window the blocks of the last window - 1 keys and of a chunk of max_chunk queries."""
        every = -(-num_tokens // block_size)
        if self.window is None:
            return every
        return min(every, -(-(self.window - 1 + max_chunk) // block_size) + 1)


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]  # groups[0]: full attention (maybe without layers)
    num_slots: int  # KV tensors in the pool; each block holds num_slots layers' K and V

    @property
    def is_hybrid(self) -> bool:
        """Whether any group frees blocks (else one table serves every layer, as ever)."""
        return len(self.groups) > 1

    def group_of(self, layer: int) -> int:
        return next(g for g, group in enumerate(self.groups) if layer in group.layers)

    def slot_of(self, layer: int) -> int:
        return self.groups[self.group_of(layer)].layers.index(layer)

    def blocks_per_seq(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks of the shared pool one sequence of num_tokens tokens holds at most, over every
        group whose blocks are in the pool (a group 0 without layers keeps none there)."""
        return sum(
            g.blocks_per_seq(num_tokens, block_size, max_chunk) for g in self.groups if g.layers
        )

    def max_tokens_held(self, num_blocks: int, block_size: int, max_chunk: int, limit: int) -> int:
        """The longest sequence (up to `limit` tokens) whose blocks fit num_blocks."""
        lo, hi = 0, limit
        while lo < hi:  # blocks_per_seq grows with the tokens
            mid = (lo + hi + 1) // 2
            if self.blocks_per_seq(mid, block_size, max_chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def plan_layout(
    windows: Sequence[int | None],
    window_groups: bool = True,
    max_model_len: int = 0,
    owns_kv: Sequence[bool] | None = None,
) -> KVLayout:
    """The groups of a model whose layer i has window windows[i] (None: full attention).
    Without windows, or with window_groups off, one group of every layer (window None: its
    blocks are kept whole, and each layer's attention still masks its own window). A window
    no shorter than max_model_len (when given) never lets a block go, so its layers stay with
    the full ones: a job of short requests on Gemma 3 pays nothing for the groups.
    Layers with owns_kv[i] False (Gemma 4's KV-shared layers, which read an earlier layer's
    cache) are in no group: they take no slot and no block."""
    if max_model_len:
        windows = [w if w is not None and w < max_model_len else None for w in windows]
    owners = [i for i in range(len(windows)) if owns_kv is None or owns_kv[i]]
    every = tuple(owners)
    if not window_groups or all(windows[i] is None for i in owners):
        return KVLayout((KVGroup(None, every),), len(every))
    full = tuple(i for i in owners if windows[i] is None)
    kinds: dict[int, list[int]] = {}
    for i in owners:
        if windows[i] is not None:
            kinds.setdefault(windows[i], []).append(i)
    size = min([len(full)] * bool(full) + [len(layers) for layers in kinds.values()])
    groups = [KVGroup(None, full)]
    for window, layers in sorted(kinds.items()):
        groups += [
            KVGroup(window, tuple(layers[at : at + size])) for at in range(0, len(layers), size)
        ]
    return KVLayout(tuple(groups), size)

"""Shared prefixes' K and V kept gathered from one decode step to the next (torch backend).

A decode group's shared prefix (the document every chunk's prompt repeats) is the same blocks
with the same contents at every step of the group; only the rows' private blocks grow.
Gathering it out of the paged pool (and dequantizing an FP8 cache) per layer per step was
most of the shared part's cost on the CPU, so each layer keeps the prefixes it gathered, as
contiguous [1, kv_heads, S, head_dim] K and V in the queries' dtype, keyed by their block ids.

Why this is safe: a block's contents change only when a token's K/V is written into it, and
every write of a layer's cache is the backend's `write_kv` at the step's `slot_mapping`, made
before that layer's attention reads. A kept prefix is dropped at the first step that writes
any slot of its blocks (a block freed and reused for other tokens is written before anyone
reads it again), and a prefix that no group of the step reads is dropped as well, so memory
holds one copy of the current step's shared prefixes and no more, and at most KEEP_FRACTION of
the layer's own pool: prefixes past that are gathered every step as before.
"""

from __future__ import annotations

import torch

from kvbatch.engine.attention.decode_plan import DecodePlan
from kvbatch.engine.attention.kv_view import KVView

Prefix = tuple[torch.Tensor, torch.Tensor]  # K, V: [1, kv_heads, S, head_dim] each

KEEP_FRACTION = 0.25  # of a layer's KV pool bytes: the most its kept prefixes take


class GatheredPrefixes:
    """Per layer cache: the shared prefixes the last step read, by block ids."""

    def __init__(self) -> None:
        self._kept: dict[tuple, dict[tuple[int, ...], Prefix]] = {}
        self.hits = 0
        self.gathers = 0

    def read(
        self,
        view: KVView,
        block_ids: list[torch.Tensor],  # each group's shared blocks
        plan: DecodePlan,  # the step's plan: the groups' keys and the blocks the step writes
    ) -> list[Prefix]:
        """Each group's prefix K and V, gathered only where no kept copy is still valid."""
        layer = _layer_key(view)
        kept = self._kept.pop(layer, {})
        if kept and block_ids:
            written = plan.written_blocks
            kept = {ids: kv for ids, kv in kept.items() if written.isdisjoint(ids)}
        now: dict[tuple[int, ...], Prefix] = {}
        out = []
        room = KEEP_FRACTION * view.cache.numel() * view.cache.element_size()
        for table, ids in zip(block_ids, plan.prefix_keys):
            kv = now.get(ids) or kept.get(ids)
            if kv is None:
                self.gathers += 1
                keys, values = view.gather(table)  # [S, kvh, d] -> [1, kvh, S, d]
                kv = (
                    keys.transpose(0, 1)[None].contiguous(),
                    values.transpose(0, 1)[None].contiguous(),
                )
            else:
                self.hits += 1
            size = 2 * kv[0].numel() * kv[0].element_size()
            if size <= room:
                now[ids] = kv
                room -= size
            out.append(kv)
        if now:
            self._kept[layer] = now
        return out

    def release(self, view: KVView) -> None:
        """A step in which no group reads this layer's kept prefixes: let them go."""
        self._kept.pop(_layer_key(view), None)

    def clear(self) -> None:
        self._kept.clear()


def _layer_key(view: KVView) -> tuple:
    return (view.cache.data_ptr(), tuple(view.cache.shape), view.scales, view.dtype)

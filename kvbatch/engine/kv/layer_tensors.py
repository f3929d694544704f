"""Each layer's KV tensor in the pool, when layers differ in shape or share a cache.

Most models give every layer the same [2, blocks, block_size, kv_heads, head_dim] tensor
shape, one tensor per layer (or, with window groups, per slot: engine/kv/layout.py). Two
things break that, both in Gemma 4:

- layers of another shape: its full-attention layers have another head_dim and KV head count
  than its sliding ones. With window groups a slot holds layers of both kinds (slot j of block
  b is layer j of whichever group holds b), so the slot is allocated for its largest layer,
  [2, blocks, block_size x its widest token], and each layer sees the first part of every
  block as its own shape (a strided view: the block stride stays the slot's);
- KV-shared layers: a layer that reads an earlier layer's cache (ModelConfig.kv_owner) gets
  that layer's tensor and owns none.
A latent (MLA) layer caches one vector per token, not K and V (ModelConfig.kv_planes 1): its
tensor is [1, blocks, block_size, 1, R + P], and a block costs half what a K/V layer of the
same width would. A hybrid model's linear-attention layers keep no KV (ModelConfig.keeps_kv): the list holds the
layers that do, in layer order, which the model file indexes by its attention layers' count.

Blocks are zeroed, so masked-out padding positions never hold NaN (0 * NaN would poison
attention).
"""

from __future__ import annotations

import torch

from kvbatch.engine.kv.layout import KVLayout


def kv_slot_layers(cfg, layout: KVLayout | None) -> list[list[int]]:
    """The layers whose K/V each pool tensor holds: each layer that owns KV alone, or with
    window groups slot j's layer of every group."""
    if layout is None:
        return [[i] for i in range(cfg.num_layers) if cfg.kv_owner(i) == i and cfg.keeps_kv(i)]
    return [
        [g.layers[j] for g in layout.groups if j < len(g.layers)] for j in range(layout.num_slots)
    ]


def _token_elems(cfg, layer: int) -> int:
    heads, head_dim = cfg.kv_shape(layer)
    return heads * head_dim


def _planes(cfg, layers: list[int]) -> int:
    """K and V (2), or a latent's one plane, for the layers of one pool tensor."""
    planes = {cfg.kv_planes(i) for i in layers}
    if len(planes) != 1:
        raise ValueError("layers sharing a KV slot must all cache K and V, or all a latent")
    return planes.pop()


def kv_block_bytes(cfg, block_size: int, dtype: torch.dtype, layout: KVLayout | None) -> int:
    """One block's K and V (or latents) over every pool tensor, each as wide as its widest
    layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(
        _planes(cfg, layers) * block_size * max(_token_elems(cfg, i) for i in layers) * elem
        for layers in kv_slot_layers(cfg, layout)
    )


def layer_kv_tensors(
    cfg,
    layout: KVLayout | None,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """Each KV layer's [2, num_blocks, block_size, kv_heads, head_dim] cache (a latent layer's
    [1, ...]), in layer order: views of the pool tensors (the owner's for a KV-shared layer)."""
    own: dict[int, torch.Tensor] = {}
    for layers in kv_slot_layers(cfg, layout):
        shapes = {cfg.kv_shape(i) for i in layers}
        planes = _planes(cfg, layers)
        if len(shapes) == 1:  # one shape: a plain tensor, as every model had before
            heads, head_dim = shapes.pop()
            pool = torch.zeros(
                planes, num_blocks, block_size, heads, head_dim, dtype=dtype, device=device
            )
            own.update((i, pool) for i in layers)
            continue
        widest = max(_token_elems(cfg, i) for i in layers)
        pool = torch.zeros(planes, num_blocks, block_size * widest, dtype=dtype, device=device)
        for i in layers:
            heads, head_dim = cfg.kv_shape(i)
            used = pool[:, :, : block_size * heads * head_dim]
            own[i] = used.view(planes, num_blocks, block_size, heads, head_dim)
    return [own[cfg.kv_owner(i)] for i in range(cfg.num_layers) if cfg.keeps_kv(i)]

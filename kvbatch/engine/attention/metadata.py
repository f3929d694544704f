"""What attention needs about a step, and the contract every attention backend meets.

A step's tokens are laid out flat, decodes first, then prefill chunks:

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     d = one decode token per sequence
    seqs:     0  1  2    3             4          p = a chunk of a prompt (or a recompute)

Every new token's K and V are written into the cache at its slot (`block * block_size +
offset`) before any attention of that layer runs, so a chunk sees its cached prefix, itself,
and even blocks that another sequence of the same step fills (prefix hits on a block being
computed in this very step are therefore safe).

The cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V; an
MLA layer's is one latent plane, `[1, num_blocks, block_size, 1, R + P]`: engine/attention/latent.py),
in the model's dtype, or in `torch.float8_e4m3fn` with kv_cache_dtype="fp8": then it holds
k / k_scale and v / v_scale (`KVScales`, one pair per layer) and attention multiplies them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvbatch.engine.attention.cascade import DecodeGroup
from kvbatch.engine.attention.kv_scales import UNIT_KV_SCALES, KVScales
from kvbatch.engine.attention.layer_spec import FULL_ATTENTION, LayerAttention


@dataclass
class PrefillSpan:
    """One sequence's chunk of query tokens in a step."""

    query_start: int  # index of its first token in the flat step
    query_len: int
    context_len: int  # tokens it attends to: cached prefix + this chunk
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64


@dataclass
class AttentionMetadata:
    """What attention needs about a step, built once per step by the runner."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V go
    num_decode_tokens: int  # the first tokens of the step are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64 (padding rows: 0)
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, context including the new token
    prefills: list[PrefillSpan]
    # Shared-prefix groups among the decodes (engine/attention/cascade.py). When present, the decode
    # tables and lengths above cover only each row's blocks after its group's shared prefix.
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # [num_prefills, width]: the prefills' block tables in one tensor (each span's block_ids is
    # a view of its row), so a backend can pass them to one kernel without copying per span.
    prefill_block_tables: torch.Tensor | None = None
    # [3, num_prefills] int64 on the device: each span's first query row, query rows and
    # context tokens (the runner's one host-to-device copy; a backend building it from the
    # spans would copy, and wait for the queued steps, once per step).
    prefill_ranges: torch.Tensor | None = None
    # The groups packed for one kernel launch (the triton backend; CUDA graphs fill these in
    # static buffers): [num_groups, max shared blocks] tables (each group's block_ids is a view
    # of its row), [3, num_groups] (first decode row, rows, shared tokens), and the largest
    # group's rows. Groups past the real ones may have 0 rows (padding in a graph).
    decode_group_tables: torch.Tensor | None = None
    decode_group_ranges: torch.Tensor | None = None
    decode_group_max_rows: int = 0


class AttentionBackend(Protocol):
    """One attention implementation over the paged KV cache (torch's reference, Triton's kernels).

    `forward` first writes the step's new K and V into `kv_cache` at `meta.slot_mapping`, then
    attends: decode rows to their block tables (and shared-prefix groups when the metadata has
    them), prefill chunks causally to their cached prefix and themselves. It returns one output
    row per query row and must not change any other slot of the cache. An FP8 cache is written
    quantized with `scales` and read dequantized; every query sees the same (quantized) K and
    V, its own chunk's included, whichever backend runs.
    """

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scales: KVScales = UNIT_KV_SCALES,
        layer: LayerAttention = FULL_ATTENTION,  # the layer's window, scale and soft-cap
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]

    def latent_decode(
        self,
        q_latent: torch.Tensor,  # [B, H, R] MLA queries already multiplied by W_UK
        q_rope: torch.Tensor,  # [B, H, P] their rotated rope part
        latent_cache: torch.Tensor,  # [num_blocks, block_size, R + P]
        block_tables: torch.Tensor,  # [B, max_blocks]
        seq_lens: torch.Tensor,  # [B] keys each row reads, its own included
        scale: float,
    ) -> torch.Tensor: ...  # [B, H, R]: softmax(q.k) @ latent[:R] (engine/attention/latent.py)


@dataclass
class GroupedAttention:
    """A step's metadata per KV group (engine/kv/layout.py): layer i attends with
    groups[layer_group[i]], its own group's block tables and slots."""

    groups: list[AttentionMetadata]
    layer_group: list[int]

    @property
    def num_decode_tokens(self) -> int:
        return self.groups[0].num_decode_tokens


def per_layer(meta: AttentionMetadata | GroupedAttention, num_layers: int):
    """Each layer's metadata, in layer order."""
    if isinstance(meta, GroupedAttention):
        return [meta.groups[g] for g in meta.layer_group]
    return [meta] * num_layers

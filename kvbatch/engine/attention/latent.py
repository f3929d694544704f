"""Attention over a latent (MLA) cache, in plain torch: the cache write, the decode rows'
attention in the latent space, and a prefill chunk's attention over expanded K and V.

A latent layer's cache is one tensor, [1, num_blocks, block_size, 1, R + P] (K only: the
planner counts one plane, engine/kv/layer_tensors.py), read here as `latent_view`:

    [num_blocks, block_size, R + P]    each slot: normed c_kv (R), then rotated k_rope (P)

Decode (absorbed, memory-bound): the query's non-rotary part is multiplied by W_UK once
(q_latent [B, H, R]), so every head scores the cached latents themselves, as multi-query
attention with one KV head of R + P dimensions whose value is the first R:

    score(b, h, t) = (q_latent[b, h] . c_kv[t] + q_rope[b, h] . k_rope[t]) * scale
    out_latent[b, h] = softmax_t(score) @ c_kv            -> caller applies W_UV and o_proj

`latent_decode_attention` is that, with the signature of kernels/mla_attention.py's Triton
kernel (`mla_decode_attention`), so the two are interchangeable and checked against each other.

Prefill (expanded, compute-bound): the layer (engine/layers/latent_attention.py) sends the
chunk's context latents (`gather_latents` reads the cached ones) through kv_b_proj to per-head
K and V; `expanded_prefill_attention` is their causal attention in torch (SDPA), and the
Triton backend runs the same through kernels/prefill_attention.py (`latent_prefill`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvbatch.engine.attention.cascade import DecodeGroup


def latent_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, R + P] of a latent layer's [1, blocks, block_size, 1, R + P]
    cache (a view: the last dimension contiguous)."""
    return kv_cache[0, :, :, 0, :]


def write_latent(kv_cache: torch.Tensor, entries: torch.Tensor, slots: torch.Tensor) -> None:
    """Each new token's [R + P] entry into its slot (block * block_size + offset)."""
    width = kv_cache.shape[-1]
    kv_cache.view(-1, width).index_copy_(0, slots, entries.to(kv_cache.dtype))


def gather_latents(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The first `num_tokens` entries of the listed blocks, in order: [num_tokens, R + P]."""
    latent = latent_view(kv_cache)
    return torch.index_select(latent, 0, block_ids.reshape(-1)).flatten(0, 1)[:num_tokens]


def latent_attention_lse(
    q_latent: torch.Tensor,  # [B, H, R]
    q_rope: torch.Tensor,  # [B, H, P]
    latent: torch.Tensor,  # [num_blocks, block_size, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks]
    seq_lens: torch.Tensor,  # [B] keys each row reads
    scale: float,
) -> tuple[
    torch.Tensor, torch.Tensor
]:  # out [B, H, R] (q's dtype), lse [B, H] float32 (or q's if wider)
    """Each row's attention over its first seq_lens[b] latents, and its log-sum-exp, so that
    parts computed apart (a shared prefix and a private tail) merge exactly."""
    rows, r = block_tables.shape[0], q_latent.shape[-1]
    keys = torch.index_select(latent, 0, block_tables.reshape(-1).long())
    keys = keys.view(rows, -1, latent.shape[-1]).to(q_latent.dtype)  # [B, S, R + P]
    q = torch.cat((q_latent, q_rope), dim=-1)  # [B, H, R + P]
    wide = torch.promote_types(q.dtype, torch.float32)  # softmax in float32 at least
    scores = torch.matmul(q, keys.transpose(1, 2)).to(wide) * scale  # [B, H, S]
    positions = torch.arange(keys.shape[1], device=q.device)
    visible = positions[None, :] < seq_lens[:, None]  # [B, S]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]
    probs = torch.exp(scores - lse[..., None].clamp_min(-1e30)).nan_to_num(0.0)
    out = torch.matmul(probs.to(q.dtype), keys[..., :r])  # [B, H, R]
    return out, lse


LatentAttend = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""(q_latent, q_rope, latent, block_tables, seq_lens, scale) -> (out [B, H, R], lse [B, H]):
`latent_attention_lse`'s signature, which a backend's latent decode with its log-sum-exp
shares."""


def latent_decode_attention(
    q_latent: torch.Tensor,  # [B, H, R] queries already multiplied by W_UK
    q_rope: torch.Tensor,  # [B, H, P] rotated rope part of the queries
    latent_cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: tokens each row attends to, the current one included
    scale: float,
) -> torch.Tensor:  # [B, H, R] in q's dtype: softmax(q.k) @ latent[:R]
    """The torch reference of kernels/mla_attention.py's `mla_decode_attention` (same
    arguments, same result): absorbed MLA decode over the paged latent cache."""
    out, _ = latent_attention_lse(q_latent, q_rope, latent_cache, block_tables, seq_lens, scale)
    return out


def latent_cascade_decode(
    q_latent: torch.Tensor,  # [B, H, R]
    q_rope: torch.Tensor,  # [B, H, P]
    latent: torch.Tensor,  # [num_blocks, block_size, R + P]
    private_tables: torch.Tensor,  # [B, blocks] each row's blocks after its group's prefix
    private_lens: torch.Tensor,  # [B]
    groups: list[DecodeGroup],
    scale: float,
    attend: LatentAttend = latent_attention_lse,
) -> torch.Tensor:  # [B, H, R]
    """Decode rows of shared-prefix groups (engine/attention/cascade.py): each group's queries
    against its shared blocks once, merged with each row's private part by log-sum-exp.
    `attend` computes each part with its log-sum-exp: this reference, or a backend's kernel
    (the Triton backend's `latent_decode_lse`)."""
    out, lse = attend(q_latent, q_rope, latent, private_tables, private_lens, scale)
    block_size = latent.shape[1]
    for g in groups:
        rows = slice(g.start, g.end)
        n = g.end - g.start
        tables = g.block_ids[None, :].expand(n, -1)
        shared = torch.full((n,), g.block_ids.numel() * block_size, device=q_latent.device)
        s_out, s_lse = attend(q_latent[rows], q_rope[rows], latent, tables, shared, scale)
        total = torch.logaddexp(lse[rows], s_lse)
        out[rows] = out[rows] * torch.exp(lse[rows] - total)[..., None].to(
            out.dtype
        ) + s_out * torch.exp(s_lse - total)[..., None].to(out.dtype)
    return out


def expanded_prefill_attention(
    queries: torch.Tensor,  # [Q, H, N + P] the chunk's queries, the last Q of the context
    keys: torch.Tensor,  # [S, H, N + P] every context token's key (cached prefix and chunk)
    values: torch.Tensor,  # [S, H, V]
    scale: float,
) -> torch.Tensor:  # [Q, H, V]
    """Causal attention of a prefill chunk over its expanded context: query i (position
    S - Q + i) sees keys 0 .. S - Q + i."""
    q_len, s = queries.shape[0], keys.shape[0]
    q_pos = torch.arange(s - q_len, s, device=queries.device)
    mask = torch.arange(s, device=queries.device)[None, :] <= q_pos[:, None]  # [Q, S]
    out = F.scaled_dot_product_attention(
        queries.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)

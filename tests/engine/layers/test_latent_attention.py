"""MLA's two attention paths agree: a decode row attended in the latent space (W_UK absorbed
into the query, W_UV into the output: engine/layers/latent_attention.py) equals the same
token attended by the expanded path (kv_b_proj to per-head K and V, ordinary attention), over
a paged latent cache with out-of-order blocks; and the latent decode's torch reference
(engine/attention/latent.py, the Triton kernel's signature) equals attention written out from
its definition, with shared-prefix groups merged exactly."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.attention.cascade import DecodeGroup
from kvbatch.engine.attention.latent import (
    latent_cascade_decode,
    latent_decode_attention,
    latent_view,
    write_latent,
)
from kvbatch.engine.attention.metadata import AttentionMetadata, PrefillSpan
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend
from kvbatch.engine.attention.triton_backend import TritonAttentionBackend
from kvbatch.engine.layers.latent_attention import LatentAttention
from kvbatch.engine.layers.rotary import RotaryEmbedding
from kvbatch.engine.model.latent_attention import LatentAttentionConfig
from kvbatch.engine.model.rope import RopeConfig

BLOCK = 4
R, P, N, V, H = 16, 8, 12, 10, 3


def _layer(q_lora: int | None, seed: int) -> LatentAttention:
    cfg = LatentAttentionConfig(
        num_heads=H, q_lora_rank=q_lora, kv_lora_rank=R, qk_nope_head_dim=N,
        qk_rope_head_dim=P, v_head_dim=V, scale=0.3, rope_interleave=True,
    )  # fmt: skip
    layer = LatentAttention(32, cfg).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return layer


def _meta(slots, decode: bool, table, context: int) -> AttentionMetadata:
    n = len(slots)
    if decode:
        return AttentionMetadata(slots, n, table[None], torch.tensor([context]), [])
    span = PrefillSpan(0, n, context, table)
    return AttentionMetadata(slots, 0, torch.zeros(0, 1, dtype=torch.long),
                             torch.zeros(0, dtype=torch.long), [span])  # fmt: skip


@pytest.mark.parametrize("q_lora", [None, 20], ids=["q_proj", "q_lora"])
def test_absorbed_decode_equals_expanded(q_lora):
    """The last token of a 23-token context, once by each path, over the same cache."""
    layer = _layer(q_lora, seed=1)
    rotary = RotaryEmbedding(RopeConfig(head_dim=P))
    x = torch.randn(23, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    table = torch.tensor([5, 0, 3, 1, 6, 2])  # out of order
    pos = torch.arange(23)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    backend = TorchAttentionBackend()
    outs = []
    for decode in (True, False):
        cache = torch.zeros(1, 8, BLOCK, 1, R + P, dtype=torch.float64)
        head = _meta(slots[:22], False, table, 22)
        layer(x[:22], rotary(pos[:22], x.dtype), cache, head, backend)
        last = _meta(slots[22:], decode, table, 23)
        outs.append(layer(x[22:], rotary(pos[22:], x.dtype), cache, last, backend))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-10, rtol=1e-10)


def _reference(q_latent, q_rope, entries, lens, scale):
    """Attention written out per row: scores over the first lens[b] entries."""
    out = []
    for b, n in enumerate(lens.tolist()):
        keys = entries[b][:n]  # [n, R + P]
        scores = (torch.cat((q_latent[b], q_rope[b]), -1) @ keys.T) * scale  # [H, n]
        out.append(torch.softmax(scores, -1) @ keys[:, :R])
    return torch.stack(out)


def test_latent_decode_reference_and_shared_groups():
    g = torch.Generator().manual_seed(3)
    num_blocks, lens = 12, torch.tensor([9, 13, 13, 5], dtype=torch.int32)
    cache = torch.zeros(1, num_blocks, BLOCK, 1, R + P, dtype=torch.float64)
    # rows 1 and 2 share blocks 7 and 4 (8 tokens), then each has its own
    tables = torch.tensor([[2, 9, 0, 0], [7, 4, 1, 10], [7, 4, 3, 11], [5, 8, 0, 0]])
    used = torch.unique(tables)
    write_latent(
        cache,
        torch.randn(len(used) * BLOCK, R + P, generator=g, dtype=torch.float64),
        (used[:, None] * BLOCK + torch.arange(BLOCK)).flatten(),
    )
    latent = latent_view(cache)
    q_latent = torch.randn(4, H, R, generator=g, dtype=torch.float64)
    q_rope = torch.randn(4, H, P, generator=g, dtype=torch.float64)
    entries = latent[tables.long()].flatten(1, 2)  # [B, blocks * BLOCK, R + P]
    want = _reference(q_latent, q_rope, entries, lens, 0.25)
    got = latent_decode_attention(q_latent, q_rope, latent, tables.int(), lens, 0.25)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    # the same rows as a shared-prefix group [1, 3) over blocks 7, 4 and private tails
    private = torch.tensor([[2, 9, 0], [1, 10, 0], [3, 11, 0], [5, 8, 0]])
    private_lens = torch.tensor([9, 5, 5, 5])
    group = DecodeGroup(1, 3, torch.tensor([7, 4]))
    grouped = latent_cascade_decode(q_latent, q_rope, latent, private, private_lens, [group], 0.25)
    torch.testing.assert_close(grouped, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "backend", [TorchAttentionBackend(), TritonAttentionBackend()], ids=["torch", "triton"]
)
def test_shared_groups_merge_through_each_backends_attention(backend):
    """latent_cascade_decode with a backend's `latent_decode_lse` (the Triton kernel's
    log-sum-exp under the interpreter) gives the rows' plain decode."""
    g = torch.Generator().manual_seed(5)
    cache = torch.zeros(1, 12, BLOCK, 1, R + P)
    tables = torch.tensor([[7, 4, 1, 10], [7, 4, 3, 11], [7, 4, 2, 0]])
    used = torch.unique(tables)
    write_latent(
        cache,
        torch.randn(len(used) * BLOCK, R + P, generator=g),
        (used[:, None] * BLOCK + torch.arange(BLOCK)).flatten(),
    )
    latent = latent_view(cache)
    q_latent, q_rope = torch.randn(3, H, R, generator=g), torch.randn(3, H, P, generator=g)
    lens = torch.tensor([13, 16, 9], dtype=torch.int32)
    want = latent_decode_attention(q_latent, q_rope, latent, tables.int(), lens, 0.25)
    private = tables[:, 2:]
    private_lens = lens - 2 * BLOCK
    group = DecodeGroup(0, 3, torch.tensor([7, 4]))
    got = latent_cascade_decode(
        q_latent, q_rope, latent, private, private_lens, [group], 0.25,
        attend=backend.latent_decode_lse,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cached", [0, 5, 19])
def test_expanded_prefill_on_the_triton_kernel_matches_sdpa(cached):
    """The Triton backend's latent_prefill (the paged prefill kernel over the expanded K and
    zero-padded V, under the interpreter) equals torch's SDPA path, with and without a cached
    prefix before the chunk."""
    g = torch.Generator().manual_seed(6)
    q_len, heads, width, v_dim = 7, 3, N + P, V
    keys = torch.randn(cached + q_len, heads, width, generator=g)
    values = torch.randn(cached + q_len, heads, v_dim, generator=g)
    queries = torch.randn(q_len, heads, width, generator=g)
    want = TorchAttentionBackend.latent_prefill(queries, keys, values, 0.3)
    got = TritonAttentionBackend().latent_prefill(queries, keys, values, 0.3)
    assert got.shape == (q_len, heads, v_dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

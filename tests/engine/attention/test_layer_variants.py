"""Sliding windows, other scales and soft-caps in the torch backend: decode, prefill over a
cached prefix, and shared-prefix (cascade) decodes whose window ends inside, or before, the
shared blocks, against attention written out from its definition."""

from __future__ import annotations

import pytest
import torch

from kvbatch.engine.attention.cascade import DecodeGroup, cascade_decode
from kvbatch.engine.attention.layer_spec import LayerAttention
from kvbatch.engine.attention.metadata import AttentionMetadata, PrefillSpan
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend

BS, D = 4, 16
VARIANTS = [
    LayerAttention(sliding_window=1),
    LayerAttention(sliding_window=5),
    LayerAttention(sliding_window=10),
    LayerAttention(sliding_window=10, scale=0.3, softcap=1.5),
    LayerAttention(scale=0.2, softcap=0.7),
]
IDS = ["window-1", "window-5", "window-10", "window-capped", "capped"]


def reference(q, keys, values, q_pos, layer: LayerAttention):
    """One query row at a time: scores, cap, window mask, softmax, in float64."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)  # [S, heads, d]
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scale = D**-0.5 if layer.scale is None else layer.scale
    scores = torch.einsum("hd,shd->hs", q.double(), k) * scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    pos = torch.arange(keys.shape[0])
    seen = pos <= q_pos
    if layer.sliding_window is not None:
        seen &= pos > q_pos - layer.sliding_window
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hs,shd->hd", probs, v).float()


def gather(cache, table, length):
    keys = cache[0][torch.tensor(table)].reshape(-1, *cache.shape[3:])[:length]
    values = cache[1][torch.tensor(table)].reshape(-1, *cache.shape[3:])[:length]
    return keys, values


@pytest.mark.parametrize("layer", VARIANTS, ids=IDS)
def test_decode_and_cascade_follow_the_window(layer):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads = 8, 2
    cache = torch.randn(2, 40, BS, kv_heads, D, generator=g)
    shared = [5, 9, 2]  # 12 shared tokens
    tables = [shared + [11, 12], shared + [20], shared + [30, 31, 32], [33, 34]]
    ctx = [19, 13, 23, 6]  # windows of 5 end past the shared blocks for rows 0 and 2
    q = torch.randn(len(tables), heads, D, generator=g)
    want = torch.stack(
        [
            reference(q[i], *gather(cache, t, c), c - 1, layer)
            for i, (t, c) in enumerate(zip(tables, ctx))
        ]
    )
    width = max(map(len, tables))
    full = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 4, full, torch.tensor(ctx), [])
    plain = TorchAttentionBackend._decode(q, cache, meta, layer=layer)
    torch.testing.assert_close(plain, want, atol=1e-5, rtol=1e-5)

    private = [t[3:] for t in tables[:3]] + [tables[3]]
    pw = max(map(len, private))
    ptab = torch.tensor([t + [0] * (pw - len(t)) for t in private])
    plen = torch.tensor([c - 12 for c in ctx[:3]] + [ctx[3]])
    groups = [DecodeGroup(0, 3, torch.tensor(shared))]
    out = cascade_decode(q, cache, ptab, plen, groups, layer=layer)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", VARIANTS, ids=IDS)
@pytest.mark.parametrize("cached", [0, 7, 13])
def test_prefill_over_a_cached_prefix_follows_the_window(layer, cached):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, q_len = 4, 2, 9
    total = cached + q_len
    table = [7, 3, 12, 0, 5, 9]
    cache = torch.zeros(2, 16, BS, kv_heads, D)
    keys, values = torch.randn(2, total, kv_heads, D, generator=g)
    pos = torch.arange(total)
    slots = torch.tensor(table)[pos // BS] * BS + pos % BS
    cache[0].view(-1, kv_heads, D)[slots], cache[1].view(-1, kv_heads, D)[slots] = keys, values
    q = torch.randn(q_len, heads, D, generator=g)
    span = PrefillSpan(0, q_len, total, torch.tensor(table[: -(-total // BS)]))
    out = TorchAttentionBackend._prefill(
        q, keys[cached:], values[cached:], cache, span, layer=layer
    )
    want = torch.stack([reference(q[i], keys, values, cached + i, layer) for i in range(q_len)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_bad_variants_say_what_to_fix():
    with pytest.raises(ValueError, match="sliding_window must be 1 or more"):
        LayerAttention(sliding_window=0)
    with pytest.raises(ValueError, match="soft-cap must be positive"):
        LayerAttention(softcap=0.0)

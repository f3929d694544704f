"""Shared-prefix (cascade) decode attention equals plain paged attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvbatch.engine.attention.torch_backend as attention
from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.attention.cascade import DecodeGroup, cascade_decode, find_shared_prefixes
from kvbatch.engine.attention.metadata import AttentionMetadata
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend


def padded(tables: list[list[int]]) -> np.ndarray:
    width = max(map(len, tables))
    return np.array([t + [0] * (width - len(t)) for t in tables])


def test_groups_by_longest_common_run():
    tables = [[7, 8, 9, 1], [3, 4], [7, 8, 9, 2], [7, 8, 5], [3, 4, 6]]
    ctx = np.array([60, 20, 64, 40, 40])
    order, groups = find_shared_prefixes(padded(tables), ctx, block_size=16)
    order = order.tolist()
    assert sorted(order) == list(range(5))
    by_rows = {tuple(sorted(order[s:e])): n for s, e, n in groups}
    assert by_rows[(0, 2, 3)] == 2  # 7, 8 shared by all three
    # [3, 4] with 20 tokens keeps its newest token private: only block 3 may be shared.
    assert by_rows[(1, 4)] == 1


def test_a_lone_sequence_or_no_common_block_makes_no_group():
    order, groups = find_shared_prefixes(padded([[1, 2], [3, 4], [5]]), np.array([30, 30, 10]), 16)
    assert groups == []


def test_a_group_whose_members_differ_from_the_second_block_shares_one():
    tables = padded([[4, 5, 6, 7], [4, 5, 9, 7], [4, 8, 6, 7], [2, 5, 6]])
    order, groups = find_shared_prefixes(tables, np.array([64, 64, 64, 48]), 16)
    assert [(order[s:e].tolist(), n) for s, e, n in groups] == [([0, 1, 2], 1)]


def shared_prefixes_by_loops(tables, ctx, block_size):
    """Reference: rows sorted by their shareable blocks (those before the newest token's),
    neighbours' common runs walked in Python, cut where a pair shares less than half of
    what a neighbouring pair shares (or nothing)."""
    caps = [(c - 1) // block_size for c in ctx]
    keys = [
        tuple(t[j] if j < cap else -1 - i for j in range(len(t)))
        for i, (t, cap) in enumerate(zip(tables, caps))
    ]
    order = sorted(range(len(tables)), key=lambda i: keys[i])

    def common(a, b):
        n = 0
        while n < min(caps[a], caps[b]) and tables[a][n] == tables[b][n]:
            n += 1
        return n

    lcp = [common(a, b) for a, b in zip(order, order[1:])]
    groups, start = [], 0
    for i in range(len(order)):
        near = max(lcp[i - 1] if i > 0 else 0, lcp[i + 1] if i + 1 < len(lcp) else 0)
        if i == len(lcp) or lcp[i] == 0 or 2 * lcp[i] < near:  # the segment ends at row i
            if i > start:
                groups.append((start, i + 1, min(lcp[start:i])))
            start = i + 1
    return order, groups


def members(order, groups) -> list[tuple[tuple[int, ...], int]]:
    """Each group's rows (as a sorted tuple) and shared blocks; the order is a permutation."""
    order = list(np.asarray(order).tolist())
    assert sorted(order) == list(range(len(order)))
    return sorted((tuple(sorted(order[s:e])), n) for s, e, n in groups)


def test_rows_of_two_documents_under_one_system_prompt_make_two_groups():
    """One shared system-prompt block, then two documents: each document's rows share it and
    their document, and a lone row of a third document shares nothing."""
    system, doc_a, doc_b, doc_c = [1], [10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33]
    tables = [system + doc_a + [100 + i] for i in range(3)]
    tables += [system + doc_b + [200 + i] for i in range(2)] + [system + doc_c + [300]]
    ctx = np.array([len(t) * 16 - 3 for t in tables])
    order, groups = find_shared_prefixes(padded(tables), ctx, block_size=16)
    found = {tuple(sorted(order[s:e].tolist())): n for s, e, n in groups}
    assert found == {(0, 1, 2): 5, (3, 4): 4}


@pytest.mark.parametrize("seed", range(30))
def test_vectorised_grouping_equals_the_loops(seed):
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 6, size=rng.integers(1, 6)).tolist() for _ in range(4)]
    tables, ctx = [], []
    for _ in range(rng.integers(2, 40)):
        t = prefixes[rng.integers(0, 4)][: rng.integers(1, 6)]
        t = t + rng.integers(0, 6, size=rng.integers(0, 4)).tolist()
        if not t:
            t = [int(rng.integers(0, 6))]
        tables.append(t)
        ctx.append(int(rng.integers((len(t) - 1) * 4 + 1, len(t) * 4 + 1)))
    want = members(*shared_prefixes_by_loops(tables, ctx, 4))
    assert members(*find_shared_prefixes(padded(tables), np.array(ctx), block_size=4)) == want
    # columns of zeros past every row (a long prompt's table widens the step's) change nothing,
    # so the runner passes the decodes' own width
    wide = np.pad(padded(tables), ((0, 0), (0, 50)))
    assert members(*find_shared_prefixes(wide, np.array(ctx), block_size=4)) == want
    # nor do other rows around them: the runner passes the KV manager's whole table array and
    # the step's rows in it, here in reverse order after five rows of other sequences
    array = np.concatenate([rng.integers(0, 6, size=(5, wide.shape[1])), wide[::-1]])
    rows = 5 + np.arange(len(tables))[::-1]
    order, groups = find_shared_prefixes(array, np.array(ctx), block_size=4, rows=rows)
    assert members(order, groups) == want


def test_a_long_row_alone_in_its_group_leaves_the_groups_as_they_were():
    """Only the columns a group of two or more could share are compared: a 32k context
    decoding (2,048 blocks) beside rag-like groups changes neither the groups nor the order."""
    rng = np.random.default_rng(7)
    doc_a, doc_b = rng.integers(1, 10_000, 8).tolist(), rng.integers(1, 10_000, 8).tolist()
    tables = [doc_a + [20_000 + i] for i in range(3)] + [doc_b + [30_000 + i] for i in range(2)]
    tables.insert(2, rng.integers(40_000, 50_000, 2049).tolist())
    ctx = [len(t) * 16 - 5 for t in tables]
    order, groups = find_shared_prefixes(padded(tables), np.array(ctx), block_size=16)
    assert members(order, groups) == members(*shared_prefixes_by_loops(tables, ctx, 16))
    assert sorted(n for _, _, n in groups) == [8, 8]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3)])
def test_cascade_equals_plain_paged_attention(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    bs, d, num_blocks = 4, 16, 40
    cache = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g)
    shared = [5, 9, 2]  # three shared blocks, then private ones
    tables = [shared + [11, 12], shared + [20], shared + [30, 31, 32], [33, 34]]
    ctx = [19, 13, 23, 6]
    q = torch.randn(len(tables), heads, d, generator=g)

    width = max(map(len, tables))
    full = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    plain = TorchAttentionBackend._decode(
        q,
        cache,
        AttentionMetadata(torch.zeros(0, dtype=torch.long), 4, full, torch.tensor(ctx), []),
    )
    private = [t[3:] for t in tables[:3]] + [tables[3]]
    pw = max(map(len, private))
    ptab = torch.tensor([t + [0] * (pw - len(t)) for t in private])
    plen = torch.tensor([c - 12 for c in ctx[:3]] + [ctx[3]])
    out = cascade_decode(q, cache, ptab, plen, [DecodeGroup(0, 3, torch.tensor(shared))])
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


def test_engine_gives_the_same_tokens_with_and_without_cascade(tiny_models, monkeypatch):
    calls = []
    real = attention.cascade_decode
    monkeypatch.setattr(attention, "cascade_decode", lambda *a: calls.append(len(a[4])) or real(*a))
    g = torch.Generator().manual_seed(4)
    doc = torch.randint(3, 512, (40,), generator=g).tolist()
    prompts = [doc + torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 6, 17, 30)]
    prompts.append(torch.randint(3, 512, (9,), generator=g).tolist())
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = {}
    for cascade in (True, False):
        llm = LLM(
            model=str(tiny_models("llama-mha")),
            device="cpu",
            num_kv_blocks=64,
            max_model_len=128,
            cascade_attention=cascade,
        )
        outs[cascade] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outs[True] == outs[False]
    assert calls and max(calls) >= 1  # the cascade path really ran

"""Decode attention by parts (engine/attention/decode_rows.py, cascade.py, prefix_memo.py)
against attention written out from its definition, one row at a time in float64: mixed
batches of grouped rows and ungrouped rows (one holding a whole document), sliding windows,
scales and soft-caps, an FP8 cache, gpt-oss sinks; shared prefixes kept across steps that
are dropped when a step writes their blocks; and a step's plan (decode_plan.py) made once for
all its layers, a long ungrouped row read as a group of one."""

from __future__ import annotations

import pytest
import torch

import kvbatch.engine.attention.decode_plan as decode_plan
import kvbatch.engine.attention.decode_rows as decode_rows
import kvbatch.engine.attention.torch_backend as torch_backend
from kvbatch.engine.attention.cascade import DecodeGroup, cascade_decode
from kvbatch.engine.attention.kv_scales import UNIT_KV_SCALES, KVScales
from kvbatch.engine.attention.layer_spec import FULL_ATTENTION, LayerAttention
from kvbatch.engine.attention.metadata import AttentionMetadata
from kvbatch.engine.attention.torch_backend import TorchAttentionBackend
from kvbatch.kernels.kv_quant import dequantize_kv, quantize_kv

BS, D, HEADS, KV_HEADS = 4, 16, 8, 2
SHARED_A, SHARED_B = [5, 9, 2], [40, 41]
# Two groups, then rows with no group: a long one (a whole document) and a short one.
PRIVATE = [[11, 12], [20], [30, 31, 32], [42], [43, 44], list(range(50, 66)), [70]]
PRIVATE_LENS = [7, 1, 11, 3, 6, 61, 2]
GROUPS = [(0, 3, SHARED_A), (3, 5, SHARED_B)]
LAYERS = [
    FULL_ATTENTION,
    LayerAttention(sliding_window=5),
    LayerAttention(sliding_window=10, scale=0.3, softcap=1.5),
    LayerAttention(scale=0.2, softcap=0.7),
]
LAYER_IDS = ["full", "window-5", "window-capped", "capped"]


def full_rows() -> tuple[list[list[int]], list[int]]:
    """Each row's whole table and context length (shared prefix + private part)."""
    shared = [SHARED_A] * 3 + [SHARED_B] * 2 + [[]] * 2
    tables = [s + p for s, p in zip(shared, PRIVATE)]
    return tables, [len(s) * BS + n for s, n in zip(shared, PRIVATE_LENS)]


def make_cache(fp8: bool, scales: KVScales, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, 80, BS, KV_HEADS, D, generator=g)
    if fp8:
        return torch.stack([quantize_kv(cache[0], scales.k), quantize_kv(cache[1], scales.v)])
    return cache


def as_float(cache: torch.Tensor, scales: KVScales) -> torch.Tensor:
    if cache.dtype == torch.float32:
        return cache
    return torch.stack(
        [
            dequantize_kv(cache[0], scales.k, torch.float32),
            dequantize_kv(cache[1], scales.v, torch.float32),
        ]
    )


def reference(q, cache, table, length, layer: LayerAttention, sinks):
    """One row's query (at position length - 1) over its keys: scores, cap, window, sinks
    in the denominator, softmax, in float64."""
    keys = cache[0][torch.tensor(table)].reshape(-1, KV_HEADS, D)[:length].double()
    values = cache[1][torch.tensor(table)].reshape(-1, KV_HEADS, D)[:length].double()
    k = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scale = D**-0.5 if layer.scale is None else layer.scale
    scores = torch.einsum("hd,shd->hs", q.double(), k) * scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    pos = torch.arange(length)
    seen = pos <= length - 1
    if layer.sliding_window is not None:
        seen &= pos > length - 1 - layer.sliding_window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
    probs = torch.softmax(scores, dim=-1)[:, :length]
    return torch.einsum("hs,shd->hd", probs, v).float()


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables])


def groups() -> list[DecodeGroup]:
    return [DecodeGroup(s, e, torch.tensor(ids)) for s, e, ids in GROUPS]


@pytest.mark.parametrize("layer", LAYERS, ids=LAYER_IDS)
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("bucketed", [False, True], ids=["one-call", "octaves"])
def test_mixed_batch_equals_attention_by_definition(layer, fp8, with_sinks, bucketed, monkeypatch):
    if bucketed:  # the test's contexts are small: split them into octaves all the same
        monkeypatch.setattr(decode_rows, "MIN_PADDED_KEYS_SAVED", 0)
    scales = KVScales(0.5, 2.0) if fp8 else UNIT_KV_SCALES
    cache = make_cache(fp8, scales)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(PRIVATE), HEADS, D, generator=g)
    sinks = torch.randn(HEADS, generator=g) * 2 if with_sinks else None
    tables, ctx = full_rows()
    exact = as_float(cache, scales)
    want = torch.stack(
        [reference(q[i], exact, t, c, layer, sinks) for i, (t, c) in enumerate(zip(tables, ctx))]
    )
    got = cascade_decode(
        q, cache, padded(PRIVATE), torch.tensor(PRIVATE_LENS), groups(), scales, layer, sinks
    )
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # the same rows with no groups (each row's whole table), sinks or not, through the backend
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.long), len(q), padded(tables), torch.tensor(ctx), []
    )
    plain = TorchAttentionBackend._decode(q, cache, meta, scales, layer, sinks)
    torch.testing.assert_close(plain, want, atol=2e-5, rtol=2e-5)


def test_rows_are_not_padded_to_the_longest(monkeypatch):
    """The long ungrouped row (61 keys) is scored in its own bucket: the grouped rows' private
    parts are padded to their own octave (at most 2x), not to a whole document."""
    monkeypatch.setattr(decode_rows, "MIN_PADDED_KEYS_SAVED", 0)
    widths = []
    real = decode_rows._padded_rows
    monkeypatch.setattr(
        decode_rows,
        "_padded_rows",
        lambda q, view, tables, lens, layer: (
            widths.append((len(q), tables.shape[1])) or real(q, view, tables, lens, layer)
        ),
    )
    q = torch.randn(len(PRIVATE), HEADS, D)
    cascade_decode(
        q, make_cache(False, UNIT_KV_SCALES), padded(PRIVATE), torch.tensor(PRIVATE_LENS), groups()
    )
    assert sum(rows for rows, _ in widths) == len(PRIVATE)
    lens = torch.tensor(PRIVATE_LENS)
    assert (1, 16) in widths  # the document-long row alone
    padded_keys = sum(rows * width * BS for rows, width in widths)
    assert padded_keys <= 2 * int(lens.sum()) + BS * len(widths)
    assert padded_keys < len(PRIVATE) * 16 * BS // 3


def test_sinks_must_name_every_query_head():
    q = torch.randn(len(PRIVATE), HEADS, D)
    cache = make_cache(False, UNIT_KV_SCALES)
    with pytest.raises(ValueError, match="one logit per query head"):
        cascade_decode(
            q,
            cache,
            padded(PRIVATE),
            torch.tensor(PRIVATE_LENS),
            groups(),
            sinks=torch.zeros(KV_HEADS),
        )


def decode_step(backend, cache, q, scales=UNIT_KV_SCALES, layer=FULL_ATTENTION, write=None):
    """One decode step through the backend: every row's newest token written at its slot,
    plus the slots in `write` (another sequence's tokens), then attention."""
    g = torch.Generator().manual_seed(int(q.sum().abs() * 1000) % 1000)
    slots = [p[(n - 1) // BS] * BS + (n - 1) % BS for p, n in zip(PRIVATE, PRIVATE_LENS)]
    extra = list(write or [])
    slot_mapping = torch.tensor(slots + extra)
    n = len(slots)
    k = torch.randn(n + len(extra), KV_HEADS, D, generator=g)
    v = torch.randn(n + len(extra), KV_HEADS, D, generator=g)
    meta = AttentionMetadata(
        slot_mapping, n, padded(PRIVATE), torch.tensor(PRIVATE_LENS), [], decode_groups=groups()
    )
    qs = torch.cat([q, torch.randn(len(extra), HEADS, D, generator=g)])
    if extra:  # the other sequence's tokens as one decode-free chunk is more than we need:
        meta.prefills = []  # its K/V are written, its queries unused
    return backend.forward(qs, k, v, cache, meta, scales, layer)[:n]


def expected(cache, q, scales=UNIT_KV_SCALES, layer=FULL_ATTENTION):
    tables, ctx = full_rows()
    exact = as_float(cache, scales)
    return torch.stack(
        [reference(q[i], exact, t, c, layer, None) for i, (t, c) in enumerate(zip(tables, ctx))]
    )


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_shared_prefixes_are_gathered_once_across_steps(fp8):
    scales = KVScales(0.5, 2.0) if fp8 else UNIT_KV_SCALES
    cache = make_cache(fp8, scales)
    backend = TorchAttentionBackend()
    for _ in range(3):
        q = torch.randn(len(PRIVATE), HEADS, D)
        got = decode_step(backend, cache, q, scales)
        torch.testing.assert_close(got, expected(cache, q, scales), atol=2e-5, rtol=2e-5)
    assert (backend.prefixes.gathers, backend.prefixes.hits) == (2, 4)


def test_a_write_into_a_kept_prefix_gathers_it_again():
    """A step that writes a slot of a kept prefix's block (the block freed and reused) drops
    that prefix only; the next read sees the new contents."""
    cache = make_cache(False, UNIT_KV_SCALES)
    backend = TorchAttentionBackend()
    decode_step(backend, cache, torch.randn(len(PRIVATE), HEADS, D))
    q = torch.randn(len(PRIVATE), HEADS, D)
    got = decode_step(backend, cache, q, write=[9 * BS + 2])  # block 9: group A's prefix
    torch.testing.assert_close(got, expected(cache, q), atol=2e-5, rtol=2e-5)
    assert (backend.prefixes.gathers, backend.prefixes.hits) == (3, 1)  # A again, B kept


def test_a_step_without_groups_lets_the_kept_prefixes_go():
    cache = make_cache(False, UNIT_KV_SCALES)
    backend = TorchAttentionBackend()
    decode_step(backend, cache, torch.randn(len(PRIVATE), HEADS, D))
    tables, ctx = full_rows()
    meta = AttentionMetadata(
        torch.tensor([70 * BS + 1]), 1, padded(tables[-1:]), torch.tensor(ctx[-1:]), []
    )
    backend.forward(
        torch.randn(1, HEADS, D),
        torch.randn(1, KV_HEADS, D),
        torch.randn(1, KV_HEADS, D),
        cache,
        meta,
    )
    assert not backend.prefixes._kept


def test_engine_greedy_tokens_match_transformers_on_a_mixed_batch(tiny_models, monkeypatch):
    """A system prompt, two documents' chunk prompts and a long row of a third document in one
    batch (two groups by longest run, one row read as a group of one) on the tiny Llama:
    transformers' greedy tokens, with the kept prefixes hit across steps."""
    from kvbatch.engine import LLM, SamplingParams
    from tests.reference import hf_greedy

    monkeypatch.setattr(decode_plan, "SOLO_PREFIX_MIN_TOKENS", 40)
    g = torch.Generator().manual_seed(3)

    def tokens(n):
        return torch.randint(3, 512, (n,), generator=g).tolist()

    system, doc_a, doc_b, doc_c = tokens(20), tokens(40), tokens(30), tokens(60)
    prompts = [system + doc_a + tokens(n) for n in (3, 9, 14)]
    prompts += [system + doc_b + tokens(n) for n in (5, 11)] + [system + doc_c + tokens(4)]
    path = tiny_models("llama-mha")
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=96, max_model_len=160)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, 10, ignore_eos=True)
    assert llm.engine.runner.backend.prefixes.hits > 0


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_a_mixed_step_is_planned_once_for_all_layers(fp8, monkeypatch):
    """Layers of one step (full and windowed, each its own cache) share the step's plan:
    one plan per window size, the long ungrouped row read as a group of one in the full
    layers only, and every layer's rows equal to attention by definition. The next step's
    metadata gets new plans."""
    monkeypatch.setattr(decode_plan, "SOLO_PREFIX_MIN_TOKENS", 40)  # the 61-key row: solo
    made = []
    real = torch_backend.plan_decode
    monkeypatch.setattr(torch_backend, "plan_decode", lambda *a: made.append(a[5]) or real(*a))
    scales = KVScales(0.5, 2.0) if fp8 else UNIT_KV_SCALES
    layers = [FULL_ATTENTION, LayerAttention(sliding_window=5), FULL_ATTENTION]
    caches = [make_cache(fp8, scales, seed) for seed in range(len(layers))]
    backend = TorchAttentionBackend()
    for step in range(2):
        q = torch.randn(len(PRIVATE), HEADS, D)
        meta = AttentionMetadata(
            torch.zeros(0, dtype=torch.long), len(q), padded(PRIVATE),
            torch.tensor(PRIVATE_LENS), [], decode_groups=groups(),
        )  # fmt: skip
        for layer, cache in zip(layers, caches):
            k, v = torch.zeros(0, KV_HEADS, D), torch.zeros(0, KV_HEADS, D)
            got = backend.forward(q, k, v, cache, meta, scales, layer)
            torch.testing.assert_close(got, expected(cache, q, scales, layer), atol=2e-5, rtol=2e-5)
        assert made == [None, 5] * (step + 1)  # one plan per window size and step
        plans = {key[1]: plan for key, (_, plan) in backend._plans.items() if _ is meta}
        assert [len(plans[None].groups), len(plans[5].groups)] == [3, 2]
        assert plans[None].groups[-1].end - plans[None].groups[-1].start == 1

"""Workloads are data: the same seed gives the same prompts, and the sharing is as described."""

from __future__ import annotations

import pytest

from benchmarks.workloads import (
    FIRST_ORDINARY_TOKEN,
    WORKLOADS,
    Workload,
    get_workload,
    make_prompts,
)

VOCAB = 512
BLOCK = 16

TINY = Workload(
    name="tiny",
    model="test",
    num_documents=2,
    chunks_per_document=3,
    document_len=40,
    chunk_len=8,
    instruction_len=4,
    output_len=4,
    seed=7,
)


def test_same_seed_same_prompts_other_seed_other_prompts():
    assert make_prompts(TINY, VOCAB) == make_prompts(TINY, VOCAB)
    assert make_prompts(TINY, VOCAB) != make_prompts(TINY.with_seed(8), VOCAB)


@pytest.mark.parametrize("shared", [True, False])
def test_lengths_count_and_token_range(shared):
    w = TINY if shared else _no_share(TINY)
    prompts = make_prompts(w, VOCAB)
    assert len(prompts) == w.num_requests == 6
    assert all(len(p) == w.prompt_len == 52 for p in prompts)
    tokens = [t for p in prompts for t in p]
    assert min(tokens) >= FIRST_ORDINARY_TOKEN and max(tokens) < VOCAB
    assert all(isinstance(t, int) for t in tokens)


def test_rag_shares_exactly_the_document_within_a_group_and_the_instruction_across_all():
    w = TINY
    prompts = make_prompts(w, VOCAB)
    d, c = w.document_len, w.chunk_len
    groups = [prompts[i : i + w.chunks_per_document] for i in range(0, len(prompts), 3)]
    for group in groups:
        assert all(p[:d] == group[0][:d] for p in group)  # one document per group
        chunks = [tuple(p[d : d + c]) for p in group]
        assert len(set(chunks)) == len(chunks)  # every chunk its own
    assert groups[0][0][:d] != groups[1][0][:d]  # documents differ
    # two prompts of a group share exactly the document (for this seed their first chunk
    # tokens differ); prompts of different groups share nothing
    assert all(_common_prefix(g[0], g[1]) == d for g in groups)
    assert _common_prefix(groups[0][0], groups[1][0]) == 0
    instructions = {tuple(p[-w.instruction_len :]) for p in prompts}
    assert len(instructions) == 1


def test_no_share_prompts_share_no_first_block():
    w = _no_share(TINY)
    prompts = make_prompts(w, VOCAB)
    first_blocks = {tuple(p[:BLOCK]) for p in prompts}
    assert len(first_blocks) == len(prompts)
    tails = {tuple(p[-w.instruction_len :]) for p in prompts}
    assert len(tails) == len(prompts)  # not even the instruction is shared


def test_registry_rows():
    rag = get_workload("rag-cpu")
    assert (rag.num_requests, rag.prompt_len, rag.output_len) == (32, 464, 32)
    assert (rag.document_len, rag.chunk_len, rag.instruction_len) == (384, 64, 16)
    assert rag.shared and rag.dtype == "float32" and rag.device == "cpu"
    no_share = get_workload("no-share")
    assert not no_share.shared
    assert (no_share.num_requests, no_share.prompt_len) == (32, 464)
    assert no_share.model == rag.model
    assert set(WORKLOADS) >= {"rag-cpu", "no-share"}
    with pytest.raises(ValueError, match="rag-cpu"):
        get_workload("nope")


def test_real_vocab_prompts_are_fast_and_deterministic():
    prompts = make_prompts(get_workload("rag-cpu"), 49152)
    assert prompts == make_prompts(get_workload("rag-cpu"), 49152)
    assert _common_prefix(prompts[0], prompts[7]) == 384
    assert _common_prefix(prompts[7], prompts[8]) == 0


def test_invalid_shapes_are_rejected():
    with pytest.raises(ValueError, match="num_documents"):
        Workload("bad", "m", 0, 1, 4, 4, 4, 4)
    with pytest.raises(ValueError, match="vocab_size"):
        make_prompts(TINY, 3)


def _no_share(w: Workload) -> Workload:
    import dataclasses

    return dataclasses.replace(w, shared=False)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

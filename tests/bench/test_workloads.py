"""Workloads are data: the same seed gives the same prompts, and the sharing is as described."""

from __future__ import annotations

import pytest

from kvbatch.bench import cli
from kvbatch.bench.workloads import (
    FIRST_ORDINARY_TOKEN,
    LLAMA_1B_RANDOM,
    QWEN3_8B_RANDOM,
    RANDOM_MODELS,
    TINY_QWEN3_RANDOM,
    TINY_RANDOM,
    WORKLOADS,
    Workload,
    get_workload,
    make_long_prompt,
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


# --- the GPU workloads and their tiny variants ---------------------------------------------


def test_gpu_rows_match_shared_benchmarks_md():
    rag = get_workload("rag")
    assert (rag.num_documents, rag.chunks_per_document) == (16, 32)
    assert (rag.document_len, rag.chunk_len, rag.instruction_len) == (1024, 128, 32)
    assert (rag.num_requests, rag.prompt_len, rag.output_len) == (512, 1184, 64)
    assert rag.shared and rag.model == LLAMA_1B_RANDOM
    assert (rag.dtype, rag.device, rag.hf_batch_size) == ("bfloat16", "cuda", 64)
    assert rag.floor_seconds == 0.4 and rag.floor_device == "H200"
    no_share = get_workload("no-share-gpu")
    assert not no_share.shared and no_share.floor_seconds is None
    assert (no_share.num_requests, no_share.prompt_len, no_share.output_len) == (512, 1184, 64)
    long = get_workload("long-prefill")
    assert long.has_long_prompt and not rag.has_long_prompt
    assert (long.num_requests, long.output_len, long.long_prompt_len) == (64, 512, 32768)
    assert 0 < long.long_prompt_after < long.output_len
    assert not long.shared


@pytest.mark.parametrize("name", ["rag", "no-share-gpu", "long-prefill"])
def test_tiny_variants_keep_the_structure(name):
    full, tiny = get_workload(name), get_workload(name, tiny=True)
    assert tiny.name == f"{name}-tiny" and tiny.model == TINY_RANDOM
    assert (tiny.shared, tiny.has_long_prompt) == (full.shared, full.has_long_prompt)
    assert (tiny.dtype, tiny.device, tiny.floor_seconds) == ("float32", "cpu", None)
    assert _job_tokens(tiny) < _job_tokens(full) / 10
    assert tiny.long_prompt_len <= 4096  # fits the tiny model's context


def test_rag_qwen3_is_rag_moe_s_requests_on_qwen3_8b_s_layers():
    qwen3, moe = get_workload("rag-qwen3"), get_workload("rag-moe")
    assert qwen3.model == QWEN3_8B_RANDOM and QWEN3_8B_RANDOM in RANDOM_MODELS
    same = ("num_requests", "prompt_len", "output_len", "dtype", "device", "hf_batch_size")
    assert all(getattr(qwen3, f) == getattr(moe, f) for f in same)
    assert (qwen3.num_documents, qwen3.chunks_per_document) == (8, 16)
    assert qwen3.floor_seconds is None
    assert make_prompts(qwen3, 151936) == make_prompts(moe, 151936)  # the same prompts
    tiny = get_workload("rag-qwen3", tiny=True)
    assert (tiny.name, tiny.model) == ("rag-qwen3-tiny", TINY_QWEN3_RANDOM)
    assert TINY_QWEN3_RANDOM in RANDOM_MODELS
    assert (tiny.dtype, tiny.device) == ("float32", "cpu")


def test_rag_qwen3_tiny_runs_against_transformers(random_cache, capsys):
    """Through `kvbatch bench`, as the gpu-check step runs it: kvbatch's greedy tokens on the
    dense Qwen3 (head_dim wider than hidden / heads, q/k norms) equal transformers'."""
    assert cli.main(["rag-qwen3", "--tiny", "--peers", "hf-static", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "rag-qwen3-tiny:" in out and "model qwen3-tiny-random" in out
    hf_row = next(line for line in out.splitlines() if line.startswith("hf-static "))
    assert hf_row.split()[-1] == "4/4"  # greedy tokens equal transformers'


def test_tiny_is_refused_for_workloads_without_a_variant():
    with pytest.raises(ValueError, match="no tiny variant"):
        get_workload("rag-cpu", tiny=True)


def test_rag_prompts_share_documents_and_the_instruction():
    w = get_workload("rag", tiny=True)
    prompts = make_prompts(w, 512)
    assert len(prompts) == w.num_requests
    d = w.document_len
    per_doc = w.chunks_per_document
    docs = {tuple(p[:d]) for p in prompts}
    assert len(docs) == w.num_documents
    for g in range(w.num_documents):
        group = prompts[g * per_doc : (g + 1) * per_doc]
        assert len({tuple(p[:d]) for p in group}) == 1
        assert all(_common_prefix(group[0], p) == d for p in group[1:])
    assert len({tuple(p[-w.instruction_len :]) for p in prompts}) == 1


def test_full_rag_prompts_are_deterministic_and_in_range():
    w = get_workload("rag")
    prompts = make_prompts(w, 128256)
    assert prompts == make_prompts(w, 128256)
    assert len(prompts) == 512 and {len(p) for p in prompts} == {1184}
    assert min(min(p) for p in prompts) >= FIRST_ORDINARY_TOKEN
    assert max(max(p) for p in prompts) < 128256
    assert _common_prefix(prompts[0], prompts[31]) == 1024  # same document
    assert _common_prefix(prompts[31], prompts[32]) == 0  # next document


def test_long_prompt_is_seeded_unique_and_leaves_the_decoders_alone():
    w = get_workload("long-prefill", tiny=True)
    long = make_long_prompt(w, VOCAB)
    assert len(long) == w.long_prompt_len
    assert long == make_long_prompt(w, VOCAB)
    assert long != make_long_prompt(w.with_seed(w.seed + 1), VOCAB)
    assert min(long) >= FIRST_ORDINARY_TOKEN and max(long) < VOCAB
    decoders = make_prompts(w, VOCAB)
    assert all(_common_prefix(long, p) < BLOCK for p in decoders)
    # drawing the long prompt does not change the decoders' prompts
    assert decoders == make_prompts(w, VOCAB)
    with pytest.raises(ValueError, match="no long prompt"):
        make_long_prompt(get_workload("rag", tiny=True), VOCAB)


def test_long_prompt_must_arrive_while_the_others_decode():
    with pytest.raises(ValueError, match="long_prompt_after"):
        Workload("bad", "m", 2, 1, 0, 8, 0, 4, long_prompt_len=64, long_prompt_after=4)


def _job_tokens(w: Workload) -> int:
    return w.num_requests * (w.prompt_len + w.output_len) + w.long_prompt_len

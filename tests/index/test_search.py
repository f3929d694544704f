"""kvbatch search on bad requests: each a SearchError (a one-line `kvbatch search:` message,
exit 2) before any model loads, and never a folder created where the user mistyped a path."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from kvbatch.cli import main
from kvbatch.index.search import SearchError, search
from kvbatch.index.table import chunk_schema, connect, merge_rows


def one_row_index(tmp_path: Path, embedding_model: str, *more_models: str) -> str:
    """A real LanceDB index of one chunk whose row names `embedding_model` (and one more
    chunk per model of `more_models`)."""
    uri = str(tmp_path / "index")
    rows = [
        {
            "chunk_id": f"c{i}",
            "document_id": f"doc{i}.txt",
            "text": "Tides are caused by the Moon.",
            "embedding": [1.0] + [0.0] * 383,
            "embedding_model": model,
            "embedding_revision": "main",
        }
        for i, model in enumerate([embedding_model, *more_models])
    ]
    merge_rows(
        connect(uri), "chunks", pa.Table.from_pylist(rows, schema=chunk_schema(384)), [], source="s"
    )
    return uri


@pytest.mark.parametrize(
    ("query", "k", "message"),
    [("", 5, "the query is empty"), ("  \n", 5, "the query is empty"), ("tides", 0, "-k: 0")],
)
def test_an_empty_query_or_no_hits_asked_is_refused(tmp_path, query, k, message):
    uri = one_row_index(tmp_path, str(tmp_path / "no-model"))
    with pytest.raises(SearchError, match=message):
        search(uri, query, k)


@pytest.mark.parametrize("k", ["0", "-3"])
def test_the_command_exits_2_on_a_bad_k(tmp_path, capsys, k):
    uri = one_row_index(tmp_path, str(tmp_path / "no-model"))
    assert main(["search", uri, "tides", "-k", k]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbatch search: -k:") and "Traceback" not in err


def test_a_mistyped_index_path_is_not_created(tmp_path, capsys):
    absent = tmp_path / "indx"
    assert main(["search", str(absent), "tides"]) == 2
    assert "no index at" in capsys.readouterr().err and not absent.exists()


def test_a_file_given_as_the_index_is_refused(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(SearchError, match="no index at"):
        search(str(tmp_path / "notes.md"), "tides")


def test_an_embedding_model_gone_from_its_path_is_named(tmp_path, capsys):
    gone = str(tmp_path / "models" / "all-MiniLM-L6-v2")
    uri = one_row_index(tmp_path, gone)
    assert main(["search", uri, "tides"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvbatch search: cannot load {gone}, the embedding model")


def test_a_table_mixing_two_embedding_models_is_refused(tmp_path, minilm):
    """Rows kept from a run with another model of the same dimension (a document that failed
    after the model changed): a query vector of either model would rank the others wrongly."""
    uri = one_row_index(tmp_path, str(minilm), "org/other-384-dim-model")
    with pytest.raises(SearchError, match="holds vectors of 2 embedding models: .*other-384"):
        search(uri, "tides")


def test_a_query_longer_than_the_model_takes_is_refused(tmp_path, minilm, capsys):
    uri = one_row_index(tmp_path, str(minilm))
    assert main(["search", uri, "how do tides form " * 200]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after transformers' own warning
    assert last.startswith("kvbatch search: the query: ") and last.endswith("shorten it")

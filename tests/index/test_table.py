"""The merge on LanceDB itself: one version per run, untouched documents untouched, a
replaced document's vanished chunks removed, ids with quotes handled."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from kvbatch.index.identity import RowIdentity
from kvbatch.index.search import SearchError, search
from kvbatch.index.table import (
    TableError,
    chunk_schema,
    connect,
    document_state,
    merge_rows,
    open_table,
)

IDENT = RowIdentity("emb", "r1", "gen", "r2", "p1", "size=8,overlap=0")


def rows(items: list[tuple[str, str, str]], run: str) -> pa.Table:
    """(chunk id, document id, text) -> rows of the table's schema."""
    return pa.Table.from_pylist(
        [
            {
                "chunk_id": c,
                "document_id": d,
                "chunk_index": i,
                "document_hash": "h-" + d,
                "source": "s",
                "text": t,
                "embedding": [float(i), 1.0],
                **IDENT.__dict__,
                "run_id": run,
            }
            for i, (c, d, t) in enumerate(items)
        ],
        schema=chunk_schema(2),
    )


def test_one_merge_inserts_replaces_and_deletes_only_what_the_run_names(tmp_path):
    db = connect(str(tmp_path / "index"))
    first = merge_rows(
        db,
        "chunks",
        rows(
            [
                ("a1", "a.md", "x"),
                ("a2", "a.md", "y"),
                ("q1", "o'brien.md", "z"),
                ("k1", "keep.md", "k"),
            ],
            "run1",
        ),
        [],
        source="s",
    )
    assert first.inserted == 4
    second = merge_rows(
        db,
        "chunks",
        rows([("a1", "a.md", "x2"), ("a3", "a.md", "w")], "run2"),
        ["a.md", "o'brien.md"],
        source="s",
    )
    assert (second.inserted, second.updated, second.deleted) == (1, 1, 2)
    table = open_table(db, "chunks")
    assert first.version < second.version == table.version  # after the full-text index's upkeep
    got = {r["chunk_id"]: (r["text"], r["run_id"]) for r in table.to_arrow().to_pylist()}
    assert got == {"a1": ("x2", "run2"), "a3": ("w", "run2"), "k1": ("k", "run1")}
    assert document_state(table) == {
        "a.md": {("h-a.md", *IDENT.key())},
        "keep.md": {("h-keep.md", *IDENT.key())},
    }


def test_a_missing_table_opens_as_none(tmp_path):
    assert open_table(connect(str(tmp_path / "nothing")), "chunks") is None
    assert document_state(None) == {}


def test_an_s3_database_without_region_or_credentials_is_a_table_error(monkeypatch, tmp_path):
    """What lance raises (a RuntimeError with its Rust source location) becomes one line."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(TableError, match="cannot open the LanceDB database at s3://no-bucket/i"):
        open_table(connect("s3://no-bucket/i"), "chunks")
    with pytest.raises(SearchError, match="cannot open the LanceDB database"):
        search("s3://no-bucket/i", "tides")


HOSTILE_IDS = [
    "o'brien.txt",
    "it''s.txt",
    "back\\slash.txt",
    "\\'.txt",
    "100%.txt",
    "a%_b.txt",
    "axb.txt",
    "x') OR 1=1 --.txt",
    "x' OR document_id LIKE '%",
    "new\nline.txt",
    '"quoted".txt',
    "ünï 日本.txt",
]


@pytest.mark.parametrize("victim", HOSTILE_IDS)
def test_the_delete_filter_of_one_hostile_id_touches_no_other_document(tmp_path, victim):
    """Quotes, backslashes, LIKE wildcards and SQL in a file name: redoing (or deleting) one
    document removes its rows only."""
    db = connect(str(tmp_path / "index"))
    merge_rows(
        db, "chunks", rows([(f"{d}#1", d, "v1") for d in HOSTILE_IDS], "run-1"), [], source="s"
    )
    merged = merge_rows(
        db, "chunks", rows([(f"{victim}#2", victim, "v2")], "run-2"), [victim], source="s"
    )
    found = {(r["document_id"], r["text"]) for r in open_table(db, "chunks").to_arrow().to_pylist()}
    assert found == {(d, "v2" if d == victim else "v1") for d in HOSTILE_IDS}
    assert merged.deleted == 1

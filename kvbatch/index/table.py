"""The LanceDB table: its schema, what it holds per document, and the one merge per run.

Every row carries its `source`: the name of the spec's source that wrote it. A table may hold
the rows of several sources (one spec each); a run sees, replaces and deletes only the rows
of its own source. The merge is keyed on chunk_id (whose hash includes the source, so two
sources never share a row): a row of a chunk that is still there is updated in place, a new
chunk is inserted, and the rows of the documents this run redid or found deleted that no new
row matches are removed (`when_not_matched_by_source_delete` restricted to this source and
those documents), all in one LanceDB transaction: a reader sees the table before or after the
run, never half of it. Rows outside the filter (other documents, other sources) are untouched.

A table written before rows carried their source has no `source` column: the first run into
it adopts its rows (the column is added, holding that run's source name), since until then
one spec could only ever keep its own rows in a table.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import lancedb
import pyarrow as pa

from kvbatch.index.fulltext import refresh_fulltext_index
from kvbatch.index.identity import RowIdentity


def chunk_schema(dimension: int | None) -> pa.Schema:
    """One row per chunk. `embedding` is a FixedSizeList of float32 (LanceDB's vector column);
    absent when the embed stage is off."""
    fields = [
        pa.field("chunk_id", pa.string(), nullable=False),
        pa.field("document_id", pa.string(), nullable=False),
        pa.field("chunk_index", pa.int32()),
        pa.field("source", pa.string()),  # the name of the spec's source that owns the row
        pa.field("source_uri", pa.string()),
        pa.field("document_hash", pa.string()),
        pa.field("chunk_hash", pa.string()),
        pa.field("text", pa.string()),
        pa.field("context", pa.string()),
        pa.field("questions", pa.list_(pa.string())),
        pa.field("summary", pa.string()),
    ]
    if dimension is not None:
        fields.append(pa.field("embedding", pa.list_(pa.float32(), dimension)))
    fields += [pa.field(name, pa.string()) for name in RowIdentity.__dataclass_fields__]
    fields.append(pa.field("run_id", pa.string()))
    return pa.schema(fields)


class TableError(Exception):
    """The LanceDB database cannot be reached (no S3 credentials or region, no such bucket, an
    unreadable folder); the message names the URI and the store's own reason."""


def connect(uri: str):
    """The LanceDB database at `uri`. On S3, an endpoint from AWS_ENDPOINT_URL(_S3) (MinIO,
    moto) served over plain http is allowed, as boto3 allows it."""
    options = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if uri.startswith("s3://") and endpoint and endpoint.startswith("http://"):
        options = {"endpoint": endpoint, "allow_http": "true"}
    try:
        return lancedb.connect(uri, storage_options=options or None)
    except (OSError, RuntimeError) as e:  # lance's IO errors come as RuntimeError
        raise TableError(_unreachable(uri, e)) from e


class DamagedTable(TableError):
    """The table's manifest opens but its data cannot be read (files removed or half copied);
    the message names the table and how to get it back."""


def open_table(db, name: str):
    """The table, or None when it does not exist yet."""
    try:
        return db.open_table(name)
    except (FileNotFoundError, ValueError):
        return None
    except (OSError, RuntimeError) as e:
        raise TableError(_unreachable(f"{db.uri}", e)) from e


def open_readable(db, name: str):
    """The table, read through once (its chunk ids: every data file opened), or None when it
    does not exist yet; DamagedTable when its data is not all there, before anything writes
    to it."""
    table = open_table(db, name)
    if table is not None:
        read_rows(table, ["chunk_id"])
    return table


def read_rows(table, columns: list[str], where: str | None = None) -> list[dict]:
    """Every row's `columns` (of the rows `where` selects); DamagedTable when lance cannot read
    the data the table's manifest names."""
    query = table.search().select(columns).limit(None)
    if where is not None:
        query = query.where(where)
    try:
        return query.to_arrow().to_pylist()
    except (OSError, RuntimeError) as e:
        raise DamagedTable(damaged_message(table, e)) from e


def damaged_message(table, e: Exception) -> str:
    """One line: the table, lance's reason, and the two ways back."""
    name = table.name
    uri = str(table.uri).removesuffix("/").removesuffix(f"/{name}.lance")
    reason = " ".join(str(e).split(", /")[0].split())[:160]
    return (
        f"the table {name!r} at {uri} is damaged: its data cannot be read ({reason}); restore "
        f"a version whose files are all there (LanceDB keeps them: in Python, "
        f"t = lancedb.connect({uri!r}).open_table({name!r}); t.list_versions(); "
        f"t.restore(VERSION)), or write it anew from the sources with "
        f"`kvbatch index SPEC --rebuild`"
    )


def _unreachable(uri: str, e: Exception) -> str:
    reason = str(e).split(", /")[0]  # lance appends the Rust source location
    return f"cannot open the LanceDB database at {uri}: {reason}"


_STATE_COLUMNS = ["document_id", "document_hash", *RowIdentity.__dataclass_fields__]


def has_sources(table) -> bool:
    """False for a table written before rows carried their source (adopted by its next run)."""
    return "source" in table.schema.names


def source_filter(source: str) -> str:
    return f"source = {sql_string(source)}"


def document_state(table, source: str | None = None) -> dict[str, set[tuple[str, ...]]]:
    """document id -> the distinct (document hash, *identity) its rows carry, over the rows of
    `source` (every row when None, or when the table predates sources): one element that
    equals the current one means the document is up to date."""
    if table is None:
        return {}
    where = source_filter(source) if source is not None and has_sources(table) else None
    rows = read_rows(table, _STATE_COLUMNS, where)
    state: dict[str, set[tuple[str, ...]]] = {}
    for r in rows:
        state.setdefault(r["document_id"], set()).add(tuple(r[c] or "" for c in _STATE_COLUMNS[1:]))
    return state


@dataclass(frozen=True)
class TableModels:
    """What embeds a table's rows: its vector dimension (None without vectors) and, per
    source, the distinct (embedding model, revision) of its rows."""

    dimension: int | None
    by_source: dict[str, set[tuple[str, str]]]


def table_models(table) -> TableModels:
    dimension = None
    if "embedding" in table.schema.names:
        dimension = table.schema.field("embedding").type.list_size
    columns = ["embedding_model", "embedding_revision"]
    with_source = has_sources(table)
    rows = read_rows(table, columns + (["source"] if with_source else []))
    by_source: dict[str, set[tuple[str, str]]] = {}
    for r in rows:
        key = (r["embedding_model"] or "", r["embedding_revision"] or "")
        by_source.setdefault(r.get("source") or "", set()).add(key)
    return TableModels(dimension, by_source)


def sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def documents_filter(document_ids: Iterable[str]) -> str:
    ids = sorted(set(document_ids))
    return f"document_id IN ({', '.join(sql_string(i) for i in ids)})"


@dataclass(frozen=True)
class Merged:
    version: int  # the table's version after the merge
    inserted: int
    updated: int
    deleted: int


def write_rows(
    db, name: str, rows: pa.Table, replaced_documents: Iterable[str], *, source: str, rebuild: bool
) -> Merged:
    """The run's one write to the table: the merge (or, with --rebuild, the table anew)."""
    if rebuild:
        return rebuild_table(db, name, rows)
    return merge_rows(db, name, rows, replaced_documents, source=source)


def merge_rows(
    db, name: str, rows: pa.Table, replaced_documents: Iterable[str], *, source: str
) -> Merged:
    """Write `rows` (all of `source`) and remove what `replaced_documents` of `source` had that
    `rows` does not, in one transaction. A table that does not exist is created with the rows
    (its first version); one that predates sources is adopted by `source` first."""
    table = open_table(db, name)
    if table is None:
        created = db.create_table(name, data=rows, schema=rows.schema)
        return Merged(refresh_fulltext_index(created), rows.num_rows, 0, 0)
    if not has_sources(table):
        table.add_columns({"source": sql_string(source)})
    replaced = list(replaced_documents)
    merge = table.merge_insert("chunk_id").when_matched_update_all().when_not_matched_insert_all()
    if replaced:
        owned = f"{source_filter(source)} AND {documents_filter(replaced)}"
        merge = merge.when_not_matched_by_source_delete(owned)
    result = merge.execute(rows)
    return Merged(
        refresh_fulltext_index(table),
        result.num_inserted_rows,
        result.num_updated_rows,
        result.num_deleted_rows,
    )


def rebuild_table(db, name: str, rows: pa.Table) -> Merged:
    """`kvbatch index --rebuild`: the table dropped (whatever state it is in, damaged included)
    and written anew with `rows`, the rows of every listed document of the run's source."""
    try:
        db.drop_table(name)
    except (FileNotFoundError, ValueError):  # no such table yet
        pass
    created = db.create_table(name, data=rows, schema=rows.schema)
    return Merged(created.version, rows.num_rows, 0, 0)

"""The LanceDB table: its schema, what it holds per document, and the one merge per run.

The merge is keyed on chunk_id: a row of a chunk that is still there is updated in place, a
new chunk is inserted, and the rows of the documents this run redid or found deleted that no
new row matches are removed (`when_not_matched_by_source_delete` restricted to those
documents), all in one LanceDB transaction: a reader sees the table before or after the run,
never half of it. Rows of documents the run did not touch are outside the filter: untouched.
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


def open_table(db, name: str):
    """The table, or None when it does not exist yet."""
    try:
        return db.open_table(name)
    except (FileNotFoundError, ValueError):
        return None
    except (OSError, RuntimeError) as e:
        raise TableError(_unreachable(f"{db.uri}", e)) from e


def _unreachable(uri: str, e: Exception) -> str:
    reason = str(e).split(", /")[0]  # lance appends the Rust source location
    return f"cannot open the LanceDB database at {uri}: {reason}"


_STATE_COLUMNS = ["document_id", "document_hash", *RowIdentity.__dataclass_fields__]


def document_state(table) -> dict[str, set[tuple[str, ...]]]:
    """document id -> the distinct (document hash, *identity) its rows carry: one element that
    equals the current one means the document is up to date."""
    if table is None:
        return {}
    rows = table.search().select(_STATE_COLUMNS).limit(None).to_arrow().to_pylist()
    state: dict[str, set[tuple[str, ...]]] = {}
    for r in rows:
        state.setdefault(r["document_id"], set()).add(tuple(r[c] or "" for c in _STATE_COLUMNS[1:]))
    return state


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


def merge_rows(db, name: str, rows: pa.Table, replaced_documents: Iterable[str]) -> Merged:
    """Write `rows` and remove what `replaced_documents` had that `rows` does not, in one
    transaction. A table that does not exist is created with the rows (its first version)."""
    table = open_table(db, name)
    if table is None:
        created = db.create_table(name, data=rows, schema=rows.schema)
        return Merged(refresh_fulltext_index(created), rows.num_rows, 0, 0)
    replaced = list(replaced_documents)
    merge = table.merge_insert("chunk_id").when_matched_update_all().when_not_matched_insert_all()
    if replaced:
        merge = merge.when_not_matched_by_source_delete(documents_filter(replaced))
    result = merge.execute(rows)
    return Merged(
        refresh_fulltext_index(table),
        result.num_inserted_rows,
        result.num_updated_rows,
        result.num_deleted_rows,
    )

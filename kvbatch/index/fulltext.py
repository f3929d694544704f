"""The table's full-text (BM25) index, kept current after every merge.

LanceDB's native full-text index (`create_index(column, config=FTS())`, the form that replaced
`create_fts_index(column, use_tantivy=False)`; one index per column) covers the rows that existed when it was built or last optimised. Rows a later merge
writes are still found, by a flat scan of the unindexed fragments, and rows it deletes are
masked by their deletion vectors, so a search is never wrong, only slower, until `optimize()`
folds the new fragments into the index. A run therefore ends with:

    no index on a column that should have one -> create it (covers every row)
    an index with unindexed rows               -> optimize() (compaction + index update)

The columns: `text` always, and `context` once any row carries a context (the context stage
ran): keyword search over the context is the contextual BM25 of contextual retrieval.

No scalar index is kept on `chunk_id`, the merge key: merge_insert after optimize() with a
scalar index on the key has silently matched nothing in some LanceDB versions (lancedb
issues 3177 and 3515); the merge scans instead, which is cheap beside a run's model work.
Positions are not stored (`with_position=False`): no phrase queries are run, and optimising
position lists has crashed compaction in some versions.

optimize() never prunes old versions here (`cleanup_older_than` is a century): they are the
user's restore points (`table.restore(version)`), and pruning them is the user's choice.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from lancedb.index import FTS

FULLTEXT_COLUMNS = ("text", "context")
"""Columns that get a full-text index, when the table has rows with a value there."""

_KEEP_VERSIONS = dt.timedelta(days=36500)


@dataclass(frozen=True)
class FulltextState:
    columns: tuple[str, ...]  # columns with a full-text index
    unindexed_rows: int  # rows written since the index was last built or optimised


def fulltext_columns(table) -> tuple[str, ...]:
    """The columns of `table` that carry a full-text index, in FULLTEXT_COLUMNS order."""
    indexed = {
        tuple(i.columns)[0] for i in table.list_indices() if str(i.index_type).upper() == "FTS"
    }
    return tuple(c for c in FULLTEXT_COLUMNS if c in indexed)


def fulltext_state(table) -> FulltextState:
    """Which columns are indexed and how many rows the index does not cover yet."""
    unindexed = 0
    for index in table.list_indices():
        if str(index.index_type).upper() == "FTS":
            stats = table.index_stats(index.name)
            unindexed = max(unindexed, stats.num_unindexed_rows if stats else 0)
    return FulltextState(fulltext_columns(table), unindexed)


def _wanted_columns(table) -> list[str]:
    names = table.schema.names
    wanted = []
    for column in FULLTEXT_COLUMNS:
        if column in names and table.count_rows(f"{column} IS NOT NULL") > 0:
            wanted.append(column)
    return wanted


def refresh_fulltext_index(table) -> int:
    """Bring the full-text index of `table` up to date with its rows: an index made for each
    column that should have one and lacks it, then the new rows folded in. Returns the
    table's version afterwards (the merge's own when nothing had to change)."""
    if table.count_rows() == 0:
        return table.version
    have = set(fulltext_columns(table))
    for column in _wanted_columns(table):
        if column not in have:  # a new index covers every row there is
            table.create_index(column, config=FTS(with_position=False), replace=True)
    if fulltext_state(table).unindexed_rows > 0:
        table.optimize(cleanup_older_than=_KEEP_VERSIONS)
    return table.version

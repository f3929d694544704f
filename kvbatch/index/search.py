"""`kvbatch search URI QUERY -k N`: the query embedded by the model the table's rows were
embedded with (read from the rows), then LanceDB's nearest neighbours by cosine distance."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvbatch.engine import LLM
from kvbatch.index.table import TableError, connect, open_readable


class SearchError(Exception):
    """No such table, or a table without vectors; the message says what to do."""


@dataclass(frozen=True)
class Hit:
    document_id: str
    chunk_id: str
    score: float  # cosine similarity, 1 = the same direction
    text: str
    context: str | None
    source_uri: str


def search(uri: str, query: str, k: int = 5, *, table: str = "chunks", llm=None) -> list[Hit]:
    """The k chunks nearest to `query`. `llm` (a kvbatch.engine.LLM of the table's embedding
    model) saves loading it again when searching many times."""
    if not query.strip():
        raise SearchError("the query is empty: give the text to search for")
    if k < 1:
        raise SearchError(f"-k: {k}: give the number of hits, 1 or more")
    if not uri.startswith("s3://") and not Path(uri).is_dir():  # connect() would create it
        raise SearchError(f"no index at {uri}: run `kvbatch index` first (its output.uri)")
    try:
        tbl = open_readable(connect(uri), table)  # a damaged table: DamagedTable, one line
    except TableError as e:
        raise SearchError(str(e)) from e
    if tbl is None:
        raise SearchError(f"no table {table!r} at {uri}: run `kvbatch index` first")
    if "embedding" not in tbl.schema.names:
        raise SearchError(f"the table {table!r} at {uri} has no embeddings (stages.embed was off)")
    first = _embedding_models(tbl)
    if not first:
        return []
    if len(first) > 1:  # a query vector of one model against another's: wrong hits, silently
        named = ", ".join(f"{m} ({r})" for m, r in first)
        raise SearchError(
            f"the table {table!r} at {uri} holds vectors of {len(first)} embedding models: "
            f"{named}; run `kvbatch index` until no document fails, or index into a new table"
        )
    first = [{"embedding_model": first[0][0], "embedding_revision": first[0][1]}]
    if llm is None:
        revision = first[0]["embedding_revision"]
        extra = (
            {}
            if revision in ("", "main") or revision.startswith("local-")
            else {"revision": revision}
        )
        model = first[0]["embedding_model"]
        try:
            llm = LLM(model=model, **extra)
        except (OSError, ValueError) as e:
            raise SearchError(
                f"cannot load {model}, the embedding model of the table's rows: {e}"
            ) from e
    try:
        vector = llm.embed([query])[0]
    except ValueError as e:  # longer than the model takes
        raise SearchError(f"the query: {e}") from e
    found = (
        tbl.search(vector, vector_column_name="embedding")
        .distance_type("cosine")
        .select(["document_id", "chunk_id", "text", "context", "source_uri", "_distance"])
        .limit(k)
        .to_list()
    )
    return [
        Hit(
            document_id=r["document_id"],
            chunk_id=r["chunk_id"],
            score=1.0 - float(r["_distance"]),
            text=r["text"],
            context=r["context"],
            source_uri=r["source_uri"],
        )
        for r in found
    ]


def _embedding_models(tbl) -> list[tuple[str, str]]:
    """The distinct (embedding model, revision) of the table's rows, sorted."""
    columns = ["embedding_model", "embedding_revision"]
    rows = tbl.search().select(columns).limit(None).to_arrow().to_pylist()
    return sorted({(r["embedding_model"] or "", r["embedding_revision"] or "") for r in rows})

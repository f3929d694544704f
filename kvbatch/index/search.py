"""`kvbatch search URI QUERY -k N`: the query embedded by the model the table's rows were
embedded with (read from the rows), then LanceDB's nearest neighbours by cosine distance."""

from __future__ import annotations

from dataclasses import dataclass

from kvbatch.engine import LLM
from kvbatch.index.table import connect, open_table


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
    tbl = open_table(connect(uri), table)
    if tbl is None:
        raise SearchError(f"no table {table!r} at {uri}: run `kvbatch index` first")
    if "embedding" not in tbl.schema.names:
        raise SearchError(f"the table {table!r} at {uri} has no embeddings (stages.embed was off)")
    first = tbl.search().select(["embedding_model", "embedding_revision"]).limit(1).to_list()
    if not first:
        return []
    if llm is None:
        revision = first[0]["embedding_revision"]
        extra = (
            {}
            if revision in ("", "main") or revision.startswith("local-")
            else {"revision": revision}
        )
        llm = LLM(model=first[0]["embedding_model"], **extra)
    vector = llm.embed([query])[0]
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

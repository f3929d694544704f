"""`kvbatch search URI QUERY -k N [--mode vector|keyword|hybrid] [--rerank MODEL]`.

Two lists of chunks, fused, then optionally reranked:

    vector   the query embedded by the model the table's rows were embedded with (read from the
             rows), LanceDB's nearest neighbours by cosine distance       score: cosine similarity
    keyword  LanceDB's full-text (BM25) index over the chunk text and, where the context stage
             ran, the context (index/fulltext.py)                         score: BM25
    hybrid   both lists fused by reciprocal rank (index/fusion.py)        score: RRF sum
    rerank   the first `rerank_top` hits of the mode scored as (query, passage) pairs by a
             cross-encoder running in kvbatch's engine (LLM.score)       score: the reranker's

Hybrid is the default when the table has both a full-text index and vectors; a table with only
one of them searches with that one. Each hit names the lists it came from and its rank in each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvbatch.engine import LLM
from kvbatch.index.embed_budget import SEPARATOR
from kvbatch.index.fulltext import fulltext_columns
from kvbatch.index.fusion import reciprocal_rank_fusion
from kvbatch.index.table import TableError, connect, open_readable

MODES = ("vector", "keyword", "hybrid")
FUSED_DEPTH = 20  # chunks each list contributes to a fusion, at least
RERANK_TOP = 20  # hits of the mode a reranker scores by default
_COLUMNS = ["chunk_id", "document_id", "text", "context", "source_uri"]


class SearchError(Exception):
    """No such table, or a table without vectors; the message says what to do."""


@dataclass(frozen=True)
class Hit:
    document_id: str
    chunk_id: str
    score: float  # see the module docstring: what it measures depends on the mode
    text: str
    context: str | None
    source_uri: str
    ranks: dict[str, int] = field(default_factory=dict)  # list -> 1-based rank: vector, ...

    @property
    def lists(self) -> tuple[str, ...]:
        """The lists the hit was found in: vector, keyword (and rerank when reranked)."""
        return tuple(self.ranks)

    @property
    def passage(self) -> str:
        """What a reranker reads: the context, a blank line, the chunk (as embedded)."""
        return f"{self.context}{SEPARATOR}{self.text}" if self.context else self.text


def search(
    uri: str,
    query: str,
    k: int = 5,
    *,
    table: str = "chunks",
    mode: str | None = None,
    rerank: str | None = None,
    rerank_top: int = RERANK_TOP,
    llm=None,
    reranker=None,
) -> list[Hit]:
    """The k best chunks for `query`. `mode`: vector, keyword or hybrid (None: hybrid where
    the table allows it). `rerank`: a cross-encoder (folder or Hub id) that reorders the first
    `rerank_top` hits. `llm` (the table's embedding model) and `reranker` (the `rerank` model),
    each a kvbatch.engine.LLM, save loading them again when searching many times."""
    if not query.strip():
        raise SearchError("the query is empty: give the text to search for")
    if k < 1:
        raise SearchError(f"-k: {k}: give the number of hits, 1 or more")
    if mode is not None and mode not in MODES:
        raise SearchError(f"--mode: {mode!r}: choose one of {', '.join(MODES)}")
    reranking = rerank is not None or reranker is not None
    if reranking and rerank_top < 1:
        raise SearchError(f"--rerank-top: {rerank_top}: give the number of hits to rerank, 1+")
    tbl = _open(uri, table)
    mode = _mode_for(tbl, mode, uri, table)
    depth = max(k, rerank_top if reranking else 0, FUSED_DEPTH if mode == "hybrid" else 0)
    rows: dict[str, dict] = {}
    lists: dict[str, list[str]] = {}
    scores: dict[str, dict[str, float]] = {}
    if mode in ("vector", "hybrid"):
        found = _vector_list(tbl, query, depth, uri, table, llm)
        if found is None:  # an empty table
            return []
        lists["vector"] = _keep(found, rows, scores, "vector", lambda r: 1.0 - r["_distance"])
    if mode in ("keyword", "hybrid"):
        found = _keyword_list(tbl, query, depth)
        lists["keyword"] = _keep(found, rows, scores, "keyword", lambda r: r["_score"])
    if mode == "hybrid":
        ranked = [(f.key, f.score, f.ranks) for f in reciprocal_rank_fusion(lists)]
    else:
        ((name, keys),) = lists.items()
        ranked = [(key, scores[name][key], {name: i}) for i, key in enumerate(keys, 1)]
    hits = [_hit(rows[key], score, ranks) for key, score, ranks in ranked]
    if reranking:  # the first rerank_top reordered; the rest follow in the mode's order
        hits = _reranked(hits[:rerank_top], query, rerank, reranker) + hits[rerank_top:]
    return hits[:k]


def _open(uri: str, table: str):
    if not uri.startswith("s3://") and not Path(uri).is_dir():  # connect() would create it
        raise SearchError(f"no index at {uri}: run `kvbatch index` first (its output.uri)")
    try:
        tbl = open_readable(connect(uri), table)  # a damaged table: DamagedTable, one line
    except TableError as e:
        raise SearchError(str(e)) from e
    if tbl is None:
        raise SearchError(f"no table {table!r} at {uri}: run `kvbatch index` first")
    return tbl


def _mode_for(tbl, asked: str | None, uri: str, table: str) -> str:
    """The mode asked, if the table can serve it; else the best one it can."""
    vectors = "embedding" in tbl.schema.names
    keywords = bool(fulltext_columns(tbl))
    if asked in ("vector", "hybrid") and not vectors:
        raise SearchError(
            f"--mode {asked}: the table {table!r} at {uri} has no embeddings (stages.embed was "
            "off): search it with --mode keyword"
        )
    if asked in ("keyword", "hybrid") and not keywords:
        raise SearchError(
            f"--mode {asked}: the table {table!r} at {uri} has no full-text index yet: the next "
            "`kvbatch index` run that writes to it builds one; until then use --mode vector"
        )
    if asked is not None:
        return asked
    if vectors and keywords:
        return "hybrid"
    if vectors:
        return "vector"
    if keywords:
        return "keyword"
    raise SearchError(f"the table {table!r} at {uri} has no embeddings and no full-text index")


def _keep(found, rows, scores, name, score_of) -> list[str]:
    """The chunk ids of a list, best first; their rows and this list's scores kept."""
    scores[name] = {}
    for r in found:
        rows.setdefault(r["chunk_id"], r)
        scores[name].setdefault(r["chunk_id"], float(score_of(r)))
    return [r["chunk_id"] for r in found]


def _hit(row: dict, score: float, ranks: dict[str, int]) -> Hit:
    return Hit(
        document_id=row["document_id"],
        chunk_id=row["chunk_id"],
        score=score,
        text=row["text"],
        context=row["context"],
        source_uri=row["source_uri"],
        ranks=dict(ranks),
    )


def _keyword_list(tbl, query: str, depth: int) -> list[dict]:
    return (
        tbl.search(query, query_type="fts", fts_columns=list(fulltext_columns(tbl)))
        .select([*_COLUMNS, "_score"])
        .limit(depth)
        .to_list()
    )


def _vector_list(tbl, query: str, depth: int, uri: str, table: str, llm) -> list[dict] | None:
    models = _embedding_models(tbl)
    if not models:
        return None
    if len(models) > 1:  # a query vector of one model against another's: wrong hits, silently
        named = ", ".join(f"{m} ({r})" for m, r in models)
        raise SearchError(
            f"the table {table!r} at {uri} holds vectors of {len(models)} embedding models: "
            f"{named}; run `kvbatch index` until no document fails, or index into a new table"
        )
    model, revision = models[0]
    if llm is None:
        llm = _load(model, revision, "the embedding model of the table's rows")
    try:
        vector = llm.embed([query])[0]
    except ValueError as e:  # longer than the model takes
        raise SearchError(f"the query: {e}") from e
    return (
        tbl.search(vector, vector_column_name="embedding")
        .distance_type("cosine")
        .select([*_COLUMNS, "_distance"])
        .limit(depth)
        .to_list()
    )


def _load(model: str, revision: str, what: str):
    extra = (
        {} if revision in ("", "main") or revision.startswith("local-") else {"revision": revision}
    )
    try:
        return LLM(model=model, **extra)
    except (OSError, ValueError) as e:
        raise SearchError(f"cannot load {model}, {what}: {e}") from e


def _reranked(hits: list[Hit], query: str, model: str | None, reranker) -> list[Hit]:
    """`hits` reordered by the reranker's score of (query, passage), best first."""
    if not hits:
        return hits
    if reranker is None:
        reranker = _load(model, "", "the reranker (--rerank)")
    try:
        scores = reranker.score(query, [h.passage for h in hits], truncate=True)
    except ValueError as e:
        raise SearchError(f"--rerank: {e}") from e
    order = sorted(range(len(hits)), key=lambda i: -scores[i])
    return [
        Hit(**{**hits[i].__dict__, "score": scores[i], "ranks": {**hits[i].ranks, "rerank": n}})
        for n, i in enumerate(order, 1)
    ]


def _embedding_models(tbl) -> list[tuple[str, str]]:
    """The distinct (embedding model, revision) of the table's rows, sorted."""
    columns = ["embedding_model", "embedding_revision"]
    rows = tbl.search().select(columns).limit(None).to_arrow().to_pylist()
    return sorted({(r["embedding_model"] or "", r["embedding_revision"] or "") for r in rows})

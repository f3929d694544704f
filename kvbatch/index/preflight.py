"""Everything a run can check before it reads a document: the source is there, the models are
there and readable (their tokenizers load, their revisions are fingerprinted), the table opens
and reads, and the table takes this spec's rows (the same embedding model and dimension as
the other sources' rows). A nightly run with a wrong path fails in a second, not after it
parsed, chunked and generated for an hour."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvbatch.index.embed_budget import EmbeddingBudget
from kvbatch.index.errors import IndexRunError
from kvbatch.index.identity import RowIdentity, row_identity
from kvbatch.index.sources import SourceDocument, list_documents
from kvbatch.index.spec import IndexSpec
from kvbatch.index.table import TableModels, connect, open_table, table_models
from kvbatch.index.windows import WindowBudget
from kvbatch.jobs.model_fingerprint import FingerprintError
from kvbatch.jobs.model_info import load_tokenizer, max_model_len


@dataclass
class Checked:
    """What the checks found, for the run to use."""

    identity: RowIdentity
    listed: list[SourceDocument]  # the source's documents (listed, none read yet)
    embedding_tokenizer: object
    embedding_budget: EmbeddingBudget
    windows: WindowBudget | None  # None without a generation stage
    db: object  # the LanceDB connection
    table: object | None  # the table, read through; None when absent or rebuilt


def preflight(spec: IndexSpec, rebuild: bool = False) -> Checked:
    """Every check that needs no document; IndexRunError (SourceError for the source,
    TableError for a table that cannot be read) on the first that fails. `rebuild`: the table is not read (it is written
    anew, whatever state it is in)."""
    listed = list_documents(spec.source)  # SourceError: no such folder, no document matches
    try:
        identity = row_identity(spec)
    except FingerprintError as e:
        raise IndexRunError(f"models: cannot fingerprint a model: {e}") from e
    tokenizer = _tokenizer(spec.models.embedding, "embedding")
    try:
        budget = EmbeddingBudget(
            tokenizer, max_model_len(spec.models.embedding, tokenizer=tokenizer)
        )
    except (OSError, ValueError) as e:
        raise IndexRunError(
            f"models.embedding: cannot read the config of {spec.models.embedding}: {e}"
        ) from e
    windows = None
    if spec.stages.generates:
        windows = _window_budget(spec)
    db = connect(spec.output.uri)
    table = None if rebuild else open_table(db, spec.output.table)
    if table is not None:  # table_models reads every row: DamagedTable when it cannot
        _table_takes(spec, identity, table_models(table))
    return Checked(identity, listed, tokenizer, budget, windows, db, table)


def _tokenizer(model: str, role: str):
    if model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
        raise IndexRunError(f"models.{role}: cannot load the tokenizer of {model}: no such folder")
    try:
        return load_tokenizer(model)
    except (OSError, ValueError) as e:
        raise IndexRunError(f"models.{role}: cannot load the tokenizer of {model}: {e}") from e


def _window_budget(spec: IndexSpec) -> WindowBudget:
    """The generation model's tokenizer and context: what a prompt may hold of a document."""
    model = spec.models.generation
    tokenizer = _tokenizer(model, "generation")
    try:
        limit = max_model_len(model, spec.engine.get("max_model_len"), tokenizer=tokenizer)
    except (OSError, ValueError) as e:
        raise IndexRunError(f"models.generation: cannot read the config of {model}: {e}") from e
    return WindowBudget.for_stages(tokenizer, limit, spec.stages)


def embedding_dimension(model: str) -> int | None:
    """The width of the model's vectors from its config.json (the engine pools the last
    hidden state, no projection after it); None when it cannot be told before loading (a Hub
    id not downloaded, a .gguf file)."""
    config = Path(model).expanduser() / "config.json"
    try:
        size = json.loads(config.read_text()).get("hidden_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) else None


def _table_takes(spec: IndexSpec, identity: RowIdentity, found: TableModels) -> None:
    """The table's vectors must all be of one model: refuse a spec whose embedding model (or
    its dimension) differs from the other sources' rows (this source's own rows would be
    redone, which is a normal model change)."""
    table = f"{spec.output.table!r} at {spec.output.uri}"
    way_out = (
        "index into another table (output.table), or write this one anew with "
        "`kvbatch index SPEC --rebuild` (it drops the rows of every source)"
    )
    ours = (identity.embedding_model, identity.embedding_revision)
    dimension = embedding_dimension(spec.models.embedding) if spec.stages.embed else None
    if dimension is not None and found.dimension is not None and dimension != found.dimension:
        raise IndexRunError(
            f"models.embedding: {ours[0]} gives {dimension}-dimensional vectors but the table "
            f"{table} holds {found.dimension}-dimensional ones ({_models(found)}): {way_out}"
        )
    owner = spec.source.owner
    for source, models in sorted(found.by_source.items()):
        if source in (owner, ""):  # ours ("": a table from before sources, adopted)
            continue
        other = sorted(m for m in models if not _same_model(m, ours))
        if other:
            model, revision = other[0]
            raise IndexRunError(
                f"models.embedding: {ours[0]} (revision {ours[1]}) is not the embedding model "
                f"of the table {table}: the rows of source {source!r} are of {model} "
                f"(revision {revision}), and one search cannot compare the vectors of two "
                f"models: {way_out}"
            )


def _same_model(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """The same (model, revision); a local checkpoint is known by its fingerprint, wherever
    it lies (two machines keep it in different folders)."""
    if a[1].startswith("local-") and b[1].startswith("local-"):
        return a[1] == b[1]
    return a == b


def _models(found: TableModels) -> str:
    models = sorted({m for ms in found.by_source.values() for m, _ in ms})
    return ", ".join(models) or "no rows"

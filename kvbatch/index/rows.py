"""The run's rows: one per chunk of each document done this run, as an Arrow table (what the
LanceDB merge takes), and the same rows as Parquet in the run's folder with a manifest, for
any other store to load."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvbatch.index.generate import Generated
from kvbatch.index.identity import RowIdentity
from kvbatch.index.plan import WorkDocument
from kvbatch.index.table import chunk_schema
from kvbatch.jobs.storage import Storage


def build_rows(
    docs: list[WorkDocument],
    generated: Generated,
    vectors: dict[str, np.ndarray] | None,
    dimension: int | None,
    identity: RowIdentity,
    run_id: str,
    source: str,
) -> pa.Table:
    """Rows of `docs` (the documents that got through every stage), in document order, owned
    by `source`."""
    ident = asdict(identity)
    rows = []
    for doc in docs:
        for chunk in doc.chunks:
            row = {
                "chunk_id": chunk.chunk_id,
                "document_id": doc.id,
                "chunk_index": chunk.index,
                "source": source,
                "source_uri": doc.uri,
                "document_hash": doc.hash,
                "chunk_hash": chunk.chunk_hash,
                "text": chunk.text,
                "context": generated.context.get(chunk.chunk_id),
                "questions": generated.questions.get(chunk.chunk_id),
                "summary": generated.summary.get(doc.id),
                **ident,
                "run_id": run_id,
            }
            if dimension is not None:
                row["embedding"] = vectors[chunk.chunk_id]
            rows.append(row)
    return pa.Table.from_pylist(rows, schema=chunk_schema(dimension))


def write_run_files(folder: Storage, rows: pa.Table, manifest: dict) -> None:
    """chunks.parquet, then manifest.json (written last: a manifest means the Parquet beside it
    is whole). Each is written whole or not at all (a local file replaced after its fsync, an
    S3 object put once), never through a link."""
    with folder.join("chunks.parquet").open_write() as f:
        pq.write_table(rows, f)
    text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    folder.join("manifest.json").write_bytes(text.encode("utf-8"))

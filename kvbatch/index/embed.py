"""The embed stage as an embeddings job: one line per chunk, the chunk's text with its context
before it when the context stage ran (contextual embeddings). An input longer than the
embedding model takes is the job's error line, and its document's error record here."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvbatch.index.embed_budget import EmbeddingBudget
from kvbatch.index.generate import Generated
from kvbatch.index.plan import WorkDocument
from kvbatch.index.report import ErrorRecord
from kvbatch.index.stage_jobs import StageAnswers, embedding_line, embedding_vector


def embedding_lines(
    docs: list[WorkDocument], generated: Generated, model: str, budget: EmbeddingBudget
) -> Iterator[dict]:
    for doc in docs:
        for chunk in doc.chunks:
            text = budget.input_for(chunk.text, generated.context.get(chunk.chunk_id))
            yield embedding_line(f"embed:{chunk.chunk_id}", model, text)


def read_vectors(
    docs: list[WorkDocument], answers: StageAnswers
) -> tuple[dict[str, np.ndarray], list[ErrorRecord]]:
    """Vectors by chunk id, and one error record per document with a chunk that failed."""
    vectors: dict[str, np.ndarray] = {}
    errors = []
    for doc in docs:
        missing = next((c for c in doc.chunks if f"embed:{c.chunk_id}" not in answers.bodies), None)
        if missing is not None:
            err = answers.errors.get(f"embed:{missing.chunk_id}", {})
            code = err.get("code") or "missing"
            errors.append(
                ErrorRecord(
                    doc.id,
                    "embed",
                    code,
                    f"{doc.id}: chunk {missing.index} cannot be embedded: {err.get('message', 'no answer')}",
                )
            )
            continue
        for c in doc.chunks:
            vectors[c.chunk_id] = embedding_vector(answers.bodies[f"embed:{c.chunk_id}"])
    return vectors, errors

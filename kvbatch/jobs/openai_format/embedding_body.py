"""The body of a `/v1/embeddings` answer, shaped as openai's `CreateEmbeddingResponse`.

    {"object": "list", "model": "...", "usage": {"prompt_tokens": 12, "total_tokens": 12},
     "data": [{"object": "embedding", "index": 0, "embedding": [0.01, ...] | "base64..."}]}

`encoding_format="base64"` carries each vector as the base64 of its little-endian float32
bytes, which is what OpenAI sends and what its client decodes with
`np.frombuffer(base64.b64decode(s), dtype="float32")`: a quarter of the size of the JSON
floats, and exact. kvbatch.jobs.openai_format.embedding_lines builds one body per `/v1/embeddings` line
with this.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
import torch

from kvbatch.engine import EmbeddingOutput, truncate_dimensions

ENCODING_FORMATS = ("float", "base64")


def embedding_response(
    outputs: Sequence[EmbeddingOutput],
    *,
    model: str,
    encoding_format: str = "float",
    dimensions: int | None = None,
    normalize: bool = True,
) -> dict:
    """One request's answer from its inputs' outputs (in input order). `dimensions` keeps the
    first components of each vector (renormalised if `normalize`, the model's pooling says
    whether). Raises ValueError for an unknown encoding_format or dimensions out of range."""
    if not outputs:
        raise ValueError("an embeddings answer needs at least one output")
    vectors = torch.stack([o.embedding for o in outputs])
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return embedding_body(
        vectors,
        model=model,
        prompt_tokens=prompt_tokens,
        encoding_format=encoding_format,
        dimensions=dimensions,
        normalize=normalize,
    )


def embedding_body(
    vectors: torch.Tensor,
    *,
    model: str,
    prompt_tokens: int,
    encoding_format: str = "float",
    dimensions: int | None = None,
    normalize: bool = True,
) -> dict:
    """The body for `vectors` ([n, dim], one row per input)."""
    if encoding_format not in ENCODING_FORMATS:
        raise ValueError(
            f"encoding_format {encoding_format!r} is not supported; use one of "
            f"{', '.join(ENCODING_FORMATS)}"
        )
    vectors = truncate_dimensions(vectors.detach().float().cpu(), dimensions, normalize)
    rows = vectors.numpy().astype("<f4", copy=False)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(row, encoding_format)}
        for i, row in enumerate(rows)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _encode(row: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(row.tobytes()).decode("ascii")
    return row.tolist()

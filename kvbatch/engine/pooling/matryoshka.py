"""Matryoshka truncation: the first `dimensions` components of each vector.

Models trained with a Matryoshka loss keep most of their quality in a prefix of the vector.
The prefix of a unit vector is no longer a unit vector, so a model that normalises its output
is renormalised after the cut (what OpenAI's `dimensions` returns, and sentence-transformers'
`truncate_dim` with `normalize_embeddings=True`); a model that does not normalise is only cut.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_dimensions(dimensions: int | None, full: int) -> None:
    """Raise ValueError unless `dimensions` is None or an int in 1..full (the model's size)."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise ValueError(f"dimensions must be an integer, not {type(dimensions).__name__}")
    if not 1 <= dimensions <= full:
        raise ValueError(
            f"dimensions={dimensions} is out of range: this model's embeddings have {full} "
            f"dimensions; ask for 1 to {full}"
        )


def truncate_dimensions(
    vectors: torch.Tensor, dimensions: int | None, normalize: bool
) -> torch.Tensor:
    """`vectors` [n, d] cut to [n, dimensions] (None: unchanged), renormalised if `normalize`.
    Raises ValueError for a `dimensions` outside 1..d."""
    check_dimensions(dimensions, vectors.shape[-1])
    if dimensions is None:
        return vectors
    cut = vectors[..., :dimensions]
    return F.normalize(cut, p=2, dim=-1) if normalize else cut

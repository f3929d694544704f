"""What the engine hands back for an embedding request (vLLM's PoolingRequestOutput, trimmed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EmbeddingOutput:
    """One prompt's pooled vector. `embedding` is [hidden] float32 on the host, normalised
    when the model's pooling normalises; a tensor rather than a list, since an indexing run
    holds many of them (the body helper turns it into floats or base64)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: torch.Tensor
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    finished: bool = True

"""The end of every decoder: the last sublayer's output added to the residual stream, the
final norm, and the vocabulary projection of only the rows that will be sampled."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def final_logits(
    norm: nn.Module,
    hidden: torch.Tensor,  # [T, hidden]: the last sublayer's output, not yet added
    residual: torch.Tensor,  # [T, hidden]: the residual stream, this forward's own tensor
    output_embedding: torch.Tensor,  # [vocab, hidden]
    logits_indices: torch.Tensor | None,  # rows to project; None: all
    final_hidden: list[torch.Tensor] | None,  # receives every row after the norm (pooling)
) -> torch.Tensor:  # [rows, vocab] float32
    residual += hidden
    if final_hidden is not None:
        final_hidden.append(norm(residual))
    if logits_indices is not None:
        residual = residual[logits_indices]
    return F.linear(norm(residual), output_embedding).float()

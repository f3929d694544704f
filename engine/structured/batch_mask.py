"""One step's token bitmask: the constrained rows filled by their grammars, the rest open."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvbatch.engine.structured.bitmask import bitmask_words
from kvbatch.engine.structured.constraint import TokenConstraint


def fill_token_bitmask(
    grammars: Sequence[TokenConstraint | None], vocab_size: int, device: torch.device
) -> Tensor | None:
    """[B, ceil(V / 32)] int32 on `device` for a batch whose row i is constrained by
    `grammars[i]` (None: unconstrained, all ones); None when no row is constrained.

    The grammars fill a host tensor (their libraries work on the CPU); one copy moves it.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    mask = torch.full((len(grammars), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for i in rows:
        grammars[i].fill_bitmask(mask, i)
    if device.type == "cuda":
        return mask.pin_memory().to(device, non_blocking=True)
    return mask.to(device)

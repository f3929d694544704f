"""One step's token bitmask: the constrained rows filled by their grammars."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvbatch.engine.structured.bitmask import TokenBitmask, bitmask_words
from kvbatch.engine.structured.constraint import TokenConstraint


def fill_token_bitmask(
    grammars: Sequence[TokenConstraint | None], vocab_size: int, device: torch.device
) -> TokenBitmask | None:
    """The allowed next tokens of the batch rows i with a grammar (`grammars[i]` not None),
    on `device`; None when no row is constrained.

    The grammars fill a host tensor (their libraries work on the CPU); one copy moves it.
    On CUDA this runs while the step's forward is still queued on the device, so the
    grammars' work overlaps the forward.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    words = torch.empty((len(rows), bitmask_words(vocab_size)), dtype=torch.int32)
    kinds = {type(grammars[i]) for i in rows}
    if len(kinds) == 1:  # the usual case: one library for the whole batch
        kinds.pop().fill_bitmasks([grammars[i] for i in rows], words)
    else:
        for at, i in enumerate(rows):
            grammars[i].fill_bitmask(words, at)
    pin = device.type == "cuda"
    if pin:
        words = words.pin_memory()
    if len(rows) == len(grammars):
        return TokenBitmask(None, words.to(device, non_blocking=pin))
    index = torch.from_numpy(np.array(rows, dtype=np.int64))
    if pin:
        index = index.pin_memory()
    return TokenBitmask(index.to(device, non_blocking=pin), words.to(device, non_blocking=pin))

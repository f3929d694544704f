"""Token bitmasks: which tokens a grammar allows next, 32 tokens per int32 word.

Bit j of word w of a row allows token 32 * w + j (xgrammar's and llguidance's layout); a row
of all ones (-1) allows everything, which is what unconstrained rows of a batch carry.
"""

from __future__ import annotations

import torch
from torch import Tensor


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // 32)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> None:
    """Set to -inf, in place, the logits [B, V] of tokens that `bitmask` [B, W] int32 forbids.

    Runs on the logits' device: the words are unpacked by shifting against 0..31, so the whole
    batch is one broadcast and one masked_fill.
    """
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(rows, -1)  # [B, W * 32]
    if allowed.shape[1] < vocab:  # tokens past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits.masked_fill_(~allowed[:, :vocab], float("-inf"))

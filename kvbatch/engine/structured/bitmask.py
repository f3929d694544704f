"""Token bitmasks: which tokens a grammar allows next, 32 tokens per int32 word.

Bit j of word w of a row allows token 32 * w + j (xgrammar's and llguidance's layout). A
step's mask covers only its constrained rows; the others are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# _BANNED[x, j]: bit j of byte x is 0, i.e. the token it stands for is not allowed
_BANNED = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0  # [256, 8] bool
_banned_on: dict[torch.device, Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // 32)


@dataclass
class TokenBitmask:
    """The allowed next tokens of some rows of a batch."""

    rows: Tensor | None  # [R] int64: the batch rows covered; None = every row, in order
    words: Tensor  # [R, ceil(V / 32)] int32


def apply_token_bitmask(logits: Tensor, mask: TokenBitmask) -> None:
    """Set to -inf, in place, the logits [B, V] of tokens that `mask` forbids.

    Runs on the logits' device: each byte of the words indexes a [256, 8] table of banned
    bits (a quarter of the memory traffic of shifting each int32 word 32 ways), then one
    masked_fill. Little-endian words: byte b of word w holds tokens 32 w + 8 b + 0..7.
    """
    vocab = logits.shape[1]
    table = _banned_on.get(logits.device)
    if table is None:
        table = _banned_on[logits.device] = _BANNED.to(logits.device)
    words = mask.words.contiguous()
    banned = table[words.view(torch.uint8).long()].reshape(words.shape[0], -1)  # [R, W * 32]
    if banned.shape[1] < vocab:  # tokens past the grammar's vocabulary are never allowed
        banned = torch.nn.functional.pad(banned, (0, vocab - banned.shape[1]), value=True)
    banned = banned[:, :vocab]
    if mask.rows is None:
        logits.masked_fill_(banned, float("-inf"))
    else:
        logits[mask.rows] = logits[mask.rows].masked_fill(banned, float("-inf"))

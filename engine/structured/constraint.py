"""What the engine needs of a grammar that constrains one sequence's tokens."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class TokenConstraint(Protocol):
    """One sequence's grammar state: which tokens may come next, advanced token by token."""

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` [B, W] int32 (CPU)."""

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) if the grammar forbids it."""

    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its end (a stop token)."""

"""What the engine needs of a grammar that constrains one sequence's tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: job code imports Sequence without torch
    from torch import Tensor


class TokenConstraint(Protocol):
    """One sequence's grammar state: which tokens may come next, advanced token by token."""

    @staticmethod
    def fill_bitmasks(constraints: Sequence[TokenConstraint], bitmask: Tensor) -> None:
        """Write row i of `bitmask` [len(constraints), W] int32 (CPU): the allowed next
        tokens of `constraints[i]`, all of this type. One call per step for the whole
        batch, so a library can fill the rows in parallel."""

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` [B, W] int32 (CPU)."""

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (state unchanged) if the grammar forbids it."""

    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its end (a stop token)."""

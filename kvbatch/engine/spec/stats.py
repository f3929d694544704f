"""Acceptance counters of speculative decoding, per request and summed over the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Draft tokens proposed and accepted, in total and by position in the draft.

    `drafted_by_position[j]` counts the verifications that proposed a (j+1)-th draft token and
    `accepted_by_position[j]` those that accepted it; acceptance at j is their ratio.
    """

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0  # target forwards that checked drafts of this request
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    @property
    def num_rejected_tokens(self) -> int:
        return self.num_draft_tokens - self.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification: accepted drafts plus the target's own token."""
        if not self.num_verifications:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verifications

    @property
    def acceptance_by_position(self) -> list[float]:
        return [
            a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)
        ]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verification: `num_drafts` proposed, the first `num_accepted` of them accepted."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_verifications += 1
        grow = num_drafts - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for j in range(num_drafts):
            self.drafted_by_position[j] += 1
        for j in range(num_accepted):
            self.accepted_by_position[j] += 1

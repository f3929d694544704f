"""Which waiting requests run together: the oldest, and those nearest it in length.

An encoder step is one padded batch [requests, longest input], so its cost is the number of
requests times the longest length, whatever the others' lengths. Grouping inputs of similar
length keeps the padding small (sentence-transformers sorts a whole corpus by length for the
same reason); building each batch around the oldest waiting request keeps the order fair, so
short inputs never wait behind a stream of long ones.

    waiting by length:  3  5  5  6 [7] 9  12  40        [7] = the oldest
    budget 40:          3  5  5  6 [7]                  5 requests x 7 tokens = 35 <= 40
                        (9 was as near as 5, but 5 x 9 = 45 would not fit)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EncoderRequest:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    arrival: int  # order of arrival: the oldest waiting request anchors the next batch
    token_types: list[int] | None = None  # a cross-encoder's pair: segment 0, then 1

    def __len__(self) -> int:
        return len(self.token_ids)


class LengthBatcher:
    """The waiting requests, in arrival order, and the batches cut from them."""

    def __init__(self) -> None:
        self.waiting: dict[str, EncoderRequest] = {}  # request id -> request, oldest first
        self.running: list[EncoderRequest] = []  # a step runs its batch whole: empty between

    def add(self, request: EncoderRequest) -> None:
        self.waiting[request.request_id] = request

    def remove(self, request_id: str) -> bool:
        """Drop a waiting request (aborted); False if it is not waiting."""
        return self.waiting.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def next_batch(self, max_tokens: int, max_seqs: int) -> list[EncoderRequest]:
        """Take the next batch out of `waiting`: the oldest request, then its neighbours in
        length order, nearest length first, while the padded size (requests x longest) stays
        within `max_tokens` and the count within `max_seqs`. The oldest runs even when it
        alone exceeds `max_tokens`. Returned in length order."""
        if not self.waiting:
            return []
        oldest = next(iter(self.waiting.values()))
        by_length = sorted(self.waiting.values(), key=lambda r: (len(r), r.arrival))
        lo = next(i for i, r in enumerate(by_length) if r is oldest)
        hi, longest = lo + 1, len(oldest)
        while hi - lo < max_seqs:
            shorter = by_length[lo - 1] if lo > 0 else None
            longer = by_length[hi] if hi < len(by_length) else None
            options = [r for r in (shorter, longer) if r is not None]
            options.sort(key=lambda r: abs(len(r) - len(oldest)))
            fits = [r for r in options if (hi - lo + 1) * max(longest, len(r)) <= max_tokens]
            if not fits:
                break
            if fits[0] is shorter:
                lo -= 1
            else:
                hi += 1
                longest = len(fits[0])
        batch = by_length[lo:hi]
        for r in batch:
            del self.waiting[r.request_id]
        return batch

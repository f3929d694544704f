"""n-gram prompt lookup: a sequence proposes what followed its last n tokens earlier on.

For n from max_n down to min_n, the sequence's last n tokens are searched for in its own
prompt and output; the latest earlier occurrence that has tokens after it proposes up to k
of them. Copying, quoting and extraction tasks repeat long runs of the prompt, so the
proposals are often right, and they cost no model at all.

The search runs for the whole batch at once: the sequences' token ids (padded with -1) in
one [B, L] array, every window of n compared with each row's suffix in one numpy operation.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from kvbatch.engine.core.sequence import Sequence


def ngram_propose(
    token_ids: Seq[Seq[int]], ks: Seq[int], min_n: int, max_n: int, window: int | None = None
) -> list[list[int]]:
    """For each row, up to ks[i] tokens that followed the latest earlier occurrence of the
    row's longest matching suffix n-gram (n in [min_n, max_n]); [] where nothing matches.

    `window` bounds how many trailing tokens of each row are searched (None: all)."""
    batch = len(token_ids)
    out: list[list[int]] = [[] for _ in range(batch)]
    if batch == 0:
        return out
    rows = [list(t[-window:]) if window else list(t) for t in token_ids]
    lens = np.array([len(r) for r in rows], dtype=np.int64)
    width = int(lens.max())
    if width <= min_n:
        return out
    arr = np.full((batch, width + max_n), -1, dtype=np.int64)  # -1 never equals a token
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    todo = np.ones(batch, dtype=bool)  # rows still looking for a match
    for n in range(min(max_n, width - 1), min_n - 1, -1):
        idx = np.nonzero(todo & (lens > n))[0]
        if idx.size == 0:
            break
        sub = arr[idx]
        # suffix[b] = the row's last n tokens
        cols = lens[idx, None] - n + np.arange(n)[None, :]
        suffix = np.take_along_axis(sub, cols, axis=1)  # [b, n]
        windows = np.lib.stride_tricks.sliding_window_view(sub[:, :width], n, axis=1)
        match = (windows == suffix[:, None, :]).all(axis=-1)  # [b, width - n + 1]
        # A start s is useful if a token follows the occurrence: s + n < len (which also
        # excludes the suffix itself, at s = len - n).
        starts = np.arange(match.shape[1])[None, :]
        match &= starts + n < lens[idx, None]
        found = match.any(axis=1)
        last = match.shape[1] - 1 - np.argmax(match[:, ::-1], axis=1)  # latest occurrence
        for j in np.nonzero(found)[0]:
            b = int(idx[j])
            begin = int(last[j]) + n
            out[b] = rows[b][begin : begin + ks[b]]
            todo[b] = False
    return out


class NgramProposer:
    """Sets `draft_token_ids` (q one-hot: draft_probs None) for the sequences it is given."""

    def __init__(self, min_n: int, max_n: int, window: int | None = None) -> None:
        self.min_n, self.max_n, self.window = min_n, max_n, window

    def propose(self, picks: list[tuple[Sequence, int]], step: int) -> None:
        proposals = ngram_propose(
            [s.token_ids for s, _ in picks],
            [k for _, k in picks],
            self.min_n,
            self.max_n,
            self.window,
        )
        for (seq, _), drafts in zip(picks, proposals):
            seq.draft_token_ids = drafts
            seq.draft_probs = None

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per sequence."""

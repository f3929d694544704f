"""Pooling on the device, one step at a time, from the final hidden states (after the final norm).

An embedding request's prompt may be prefilled in several chunks (chunked prefill), so its
vector is built across steps:

    step 1: chunk [0, 512)    mean: partial sum of 512 rows     cls: row of position 0 kept
    step 2: chunk [512, 700)  mean: + 188 rows, / 700 -> done    cls: done    last: row 699

Mean and CLS read rows that a prefix-cache hit would have skipped, so such requests are
admitted without hits (PoolingConfig.needs_every_token); a chunk that starts at position 0
restarts the partial state, so a preempted request recomputed from scratch pools correctly.
Partial sums are float32 whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvbatch.engine.pooling.config import PoolingConfig, PoolingMethod


@dataclass(frozen=True)
class PoolingChunk:
    """One prefill-only chunk of a step: the request, where its rows sit in the step's flat
    batch, and which prompt positions they hold."""

    key: Hashable  # the request id (its partial state's key)
    pooling: PoolingConfig
    first_row: int  # row of the chunk's first token in the step's hidden states
    start: int  # prompt position of that token
    num_tokens: int
    prompt_len: int

    @property
    def ends_prompt(self) -> bool:
        return self.start + self.num_tokens == self.prompt_len


class Pooler:
    """Per-request partial states (mean sums, CLS rows) between a request's chunks, and the
    requests still to pool: while there are none, a step is not even scanned for pooling
    chunks (at 512 decodes a step, the scan alone would cost tens of microseconds)."""

    def __init__(self) -> None:
        self._partial: dict[Hashable, torch.Tensor] = {}
        self._live: set[Hashable] = set()

    def add_request(self, key: Hashable) -> None:
        """A pooling request was queued: steps are scanned for its chunks until it is done."""
        self._live.add(key)

    @property
    def active(self) -> bool:
        return bool(self._live)

    def add_step(
        self, hidden: torch.Tensor, chunks: Sequence[PoolingChunk]
    ) -> tuple[list[Hashable], torch.Tensor | None]:
        """Fold one step's chunks in; returns the requests whose prompt ended in this step and
        their vectors ([n, hidden] float32 on the device, normalised where the config says),
        in `chunks` order. `hidden`: [num_tokens, hidden] final hidden states of the step."""
        self._add_means(hidden, [c for c in chunks if c.pooling.method is PoolingMethod.MEAN])
        done: list[Hashable] = []
        vectors: list[torch.Tensor] = []
        normalize: list[bool] = []
        for c in chunks:
            if c.pooling.method is PoolingMethod.CLS and c.start == 0:
                self._partial[c.key] = hidden[c.first_row].float()
            if not c.ends_prompt:
                continue
            if c.pooling.method is PoolingMethod.LAST:
                vector = hidden[c.first_row + c.num_tokens - 1].float()
            elif c.pooling.method is PoolingMethod.MEAN:
                vector = self._take(c) / c.prompt_len
            else:
                vector = self._take(c)
            done.append(c.key)
            self._live.discard(c.key)
            vectors.append(vector)
            normalize.append(c.pooling.normalize)
        if not done:
            return done, None
        out = torch.stack(vectors)  # [n, hidden] float32
        if all(normalize):
            out = F.normalize(out, p=2, dim=-1)
        elif any(normalize):
            rows = to_device(np.array(normalize), out.device)
            out = torch.where(rows[:, None], F.normalize(out, p=2, dim=-1), out)
        return done, out

    @staticmethod
    def drop_pooling_rows(logits: torch.Tensor, seqs: list) -> tuple[torch.Tensor, list]:
        """A step's logits ([rows, vocab], `seqs` in row order) without the rows of pooling
        requests, which are never sampled, and the sequences left (a speculative chunk has
        1 + k rows)."""
        keep = [s.pooling is None for s in seqs]
        if all(keep):
            return logits, seqs
        rows = np.repeat(keep, [1 + len(s.draft_token_ids) for s in seqs])
        kept = logits[to_device(np.flatnonzero(rows), logits.device)]
        return kept, [s for s, k in zip(seqs, keep) if k]

    def _add_means(self, hidden: torch.Tensor, chunks: list[PoolingChunk]) -> None:
        """Every mean chunk's row sum in one index_add_ over the step's rows."""
        if not chunks:
            return
        sizes = np.array([c.num_tokens for c in chunks])
        starts = np.array([c.first_row for c in chunks])
        segment = np.repeat(np.arange(len(chunks)), sizes)
        rows = starts[segment] + np.arange(len(segment)) - (np.cumsum(sizes) - sizes)[segment]
        rows, segment = to_device(rows, hidden.device), to_device(segment, hidden.device)
        sums = torch.zeros(len(chunks), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, segment, hidden[rows].float())
        for i, c in enumerate(chunks):
            if c.start == 0:
                self._partial[c.key] = sums[i]
            elif c.key in self._partial:
                self._partial[c.key] = self._partial[c.key] + sums[i]
            else:  # a prefix-cache hit skipped rows the mean needs: never silently wrong
                raise _never_started(c)

    def _take(self, c: PoolingChunk) -> torch.Tensor:
        state = self._partial.pop(c.key, None)
        if state is None:
            raise _never_started(c)
        return state

    def release(self, key: Hashable) -> None:
        """Forget a request (it was aborted) and its partial state."""
        self._partial.pop(key, None)
        self._live.discard(key)

    def __len__(self) -> int:
        """Requests queued and not yet pooled: 0 once every one has its vector."""
        return len(self._live)

    @property
    def num_partial(self) -> int:
        """Requests part way through their prompt (mean sums, CLS rows held)."""
        return len(self._partial)


def _never_started(c: PoolingChunk) -> RuntimeError:
    return RuntimeError(
        f"{c.pooling.method.value} pooling of request {c.key!r} reached position {c.start} "
        "without its first rows: a request that pools every token must not take prefix hits"
    )


def pooling_chunks(chunks) -> list[PoolingChunk]:
    """The prefill-only chunks of a step, from its `(seq, num_new_tokens)` chunks in row order
    (before the step advances `seq.num_computed_tokens`); empty for a step without any."""
    found: list[PoolingChunk] = []
    row = 0
    for seq, n in chunks:
        if seq.pooling is not None:
            found.append(
                PoolingChunk(
                    seq.request_id,
                    seq.pooling,
                    row,
                    seq.num_computed_tokens,
                    n,
                    seq.num_prompt_tokens,
                )
            )
        row += n
    return found


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting: from pinned memory on CUDA (a copy from
    pageable memory would wait for every step queued on the stream, which async scheduling
    overlaps with the host's work)."""
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

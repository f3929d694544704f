"""Continuous batching with chunked prefill: which tokens of which sequences run this step.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`).
Running sequences go first, decodes before prefill chunks, so a long prompt never stalls
decoding; then waiting requests are admitted in the order given (the jobs layer hands them
over grouped by shared prefix), each reusing the cached blocks of its prefix. A sequence's
"next tokens" are simply `token_ids[num_computed_tokens:]`: a prompt being prefilled, one new
token being decoded, or a preempted sequence being recomputed all look the same.

When blocks run out, the newest running sequence is preempted: its blocks are freed (its
prefix usually stays in the prefix cache) and it goes back to the front of the queue to be
recomputed. Older sequences always finish first, so nobody starves.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engine.config import SchedulerConfig
from engine.kv_cache import KVCacheManager
from engine.sequence import Sequence, SequenceStatus


class ScheduledChunk(NamedTuple):
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence's tokens, so its last logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class SchedulerOutput(NamedTuple):
    chunks: list[ScheduledChunk]  # decodes (1 token) first, then prefill chunks
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        # Every running sequence must get at least one token a step, or it could starve.
        self.max_running = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}  # insertion order is step order
        preempted = 0
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(id(seq), seq.token_ids, n):
                victim = self.running[-1]
                budget += chosen.pop(victim, 0)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chosen[seq] = n
                budget -= n
        if not preempted:
            budget = self._admit(chosen, budget)
        chunks = [ScheduledChunk(s, n) for s, n in chosen.items()]
        chunks.sort(key=lambda c: c.num_new_tokens > 1)  # stable: decodes first
        return SchedulerOutput(chunks, preempted)

    def _admit(self, chosen: dict[Sequence, int], budget: int) -> int:
        """Admit waiting sequences in order while blocks, budget and the cap allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            computed = self.kv.get_computed_blocks(seq.token_ids)
            n = min(seq.num_tokens - computed.num_tokens, budget)
            if not self.kv.allocate_slots(id(seq), seq.token_ids, n, computed):
                break  # wait for running sequences to finish; never preempt for newcomers
            self.waiting.popleft()
            seq.num_computed_tokens = computed.num_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = computed.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq] = n
            budget -= n
        return budget

    def _preempt(self, seq: Sequence) -> None:
        """Free the newest sequence's blocks; it will be recomputed from its tokens."""
        self.running.pop()
        self.kv.free(id(seq))
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens' KV is now in the cache."""
        for seq, n in out.chunks:
            seq.num_computed_tokens += n

    def finish(self, finished: list[Sequence]) -> None:
        """Release finished sequences (their full blocks stay in the prefix cache)."""
        if not finished:
            return
        for seq in finished:
            seq.status = SequenceStatus.FINISHED
            self.kv.free(id(seq))
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
        elif seq.status is SequenceStatus.RUNNING:
            self.finish([seq])

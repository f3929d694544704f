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

Async scheduling (engine/core/llm_engine.py): a step may be scheduled while the previous one is
still running, so a sequence's newest token may be *pending* (sampled on the device, not yet
on the host). It still counts in `num_tokens`, so the sequence decodes it next; a sequence
whose pending token is its last (max_tokens or the context limit) is not scheduled again, and
a preempted sequence waits in the queue until its pending token has arrived.

Speculative decoding: a decode with k proposed tokens (`seq.draft_token_ids`, set before
`schedule`) is one chunk of 1 + k tokens, drafts counted against the budget (trimmed to fit,
dropped before anyone is preempted for them). After the forward, `accept_drafts` keeps the
accepted drafts' KV and releases the slots of the rejected ones.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import NamedTuple

from kvbatch.engine.core.config import SchedulerConfig
from kvbatch.engine.core.sequence import Sequence, SequenceStatus
from kvbatch.engine.kv.kv_cache import ComputedBlocks, KVCacheManager
from kvbatch.engine.sched.step_cost import StepCostModel, StepShape, chunk_pairs


class ScheduledChunk(NamedTuple):
    seq: Sequence
    num_new_tokens: int  # including the sequence's draft tokens, if any

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence's tokens (and drafts), so it is sampled."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens + len(
            seq.draft_token_ids
        )


class SchedulerOutput(NamedTuple):
    chunks: list[ScheduledChunk]  # decodes (1 token) first, then prefill chunks
    num_preempted: int
    shape: StepShape | None = None  # for the step cost model, when the scheduler has one

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, cost: StepCostModel | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.cost = cost  # times steps: sizes long prompts' chunks (engine/sched/step_cost.py)
        # Every running sequence must get at least one token a step, or it could starve.
        self.max_running = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._set_token_limit(seq)
        self.waiting.append(seq)

    def add_forked(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Run a sequence whose first `num_computed_tokens` tokens' blocks the KV manager
        already holds for it (KVCacheManager.fork, n > 1): it joins the running sequences as
        the newest, with the rest of its prompt to compute."""
        self._set_token_limit(seq)
        seq.num_computed_tokens = num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _set_token_limit(self, seq: Sequence) -> None:
        limit = seq.num_prompt_tokens + seq.params.max_tokens
        if self.config.max_model_len:
            limit = min(limit, self.config.max_model_len)
        seq.token_limit = limit

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}  # insertion order is step order
        preempted = 0
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        ending = 0  # running, but done once their pending token arrives: not scheduled
        for s in self.running:  # one pass, properties inlined: 512 sequences, every step
            pending = s.num_pending
            total = len(s.token_ids) + pending
            left = total - s.num_computed_tokens
            if left > 1:
                prefills.append(s)
            elif pending and total >= s.token_limit:
                # Its KV is complete (the last token's is never computed) and the step still
                # using it runs before any step scheduled now: its blocks can serve others.
                self.kv.free(id(s), s.token_ids)
                ending += 1
            elif left == 1:
                decodes.append(s)
        prefill_set = set(prefills)
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if len(seq.draft_token_ids) >= budget:  # drafts fit the budget, with the last token
                self._trim_drafts(seq, budget - 1)
            n = min(seq.num_tokens - seq.num_computed_tokens + len(seq.draft_token_ids), budget)
            if seq in prefill_set:
                n = self._cap_long_prefill(seq, n, seq.num_computed_tokens, chosen)
            while not self.kv.allocate_slots(id(seq), seq.token_ids, n):
                if seq.draft_token_ids:  # drop our own drafts before preempting anyone
                    n -= len(seq.draft_token_ids)
                    seq.clear_drafts()
                    continue
                victim = self._newest_holding_blocks()
                budget += chosen.pop(victim, 0)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chosen[seq] = n
                budget -= n
        for seq in self.running:
            if seq.draft_token_ids and seq not in chosen:
                seq.clear_drafts()  # not scheduled this step: proposed again next time
        num_running = len(self.running)
        if not preempted:
            budget = self._admit(chosen, budget, ending)
        chunks = [ScheduledChunk(s, n) for s, n in chosen.items()]
        chunks.sort(key=lambda c: c.num_new_tokens > 1)  # stable: decodes first
        shape = None
        if self.cost is not None:  # the admitted are appended to self.running
            shape = self._shape(chosen, prefills + self.running[num_running:])
        return SchedulerOutput(chunks, preempted, shape)

    @staticmethod
    def _shape(chosen: dict[Sequence, int], prefilling: list[Sequence]) -> StepShape:
        """The step as the cost model counts it; a pass over the prompt chunks only (a step
        may hold 512 decodes)."""
        tokens = pairs = longest = num_prefills = 0
        for seq in prefilling:
            n = chosen.get(seq)
            if n is None:  # not scheduled (budget) or preempted
                continue
            num_prefills += 1
            tokens += n
            pairs += chunk_pairs(n, seq.num_computed_tokens)
            longest = max(longest, n)
        return StepShape(len(chosen) - num_prefills, tokens, pairs, longest)

    def _newest_holding_blocks(self) -> Sequence:
        """The preemption victim: the newest running sequence, passing over those that end
        with their pending token (their blocks are already free)."""
        for seq in reversed(self.running):
            if not self._ends_with_pending(seq):
                return seq
        raise RuntimeError("no running sequence holds KV blocks to preempt")

    @staticmethod
    def _ends_with_pending(seq: Sequence) -> bool:
        """The sequence's pending token is its last: it finishes once that token arrives."""
        return seq.num_pending > 0 and seq.num_tokens >= seq.token_limit

    def _admit(self, chosen: dict[Sequence, int], budget: int, ending: int = 0) -> int:
        """Admit waiting sequences in order while blocks, budget and the cap allow (`ending`
        running sequences will not run again: their places count as free)."""
        while self.waiting and budget > 0 and len(self.running) - ending < self.max_running:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted while its token was in flight: wait for the token
                break
            computed = (
                self.kv.get_computed_blocks(seq.token_ids)
                if seq.takes_prefix_hits
                else ComputedBlocks([], 0)
            )
            if not self._may_open_group(seq, computed, len(self.running) - ending):
                break  # its group waits to start whole, when the running ones have finished
            n = min(seq.num_tokens - computed.num_tokens, budget)
            n = self._cap_long_prefill(seq, n, computed.num_tokens, chosen)
            if not self.kv.allocate_slots(id(seq), seq.token_ids, n, computed):
                break  # wait for running sequences to finish; never preempt for newcomers
            self.waiting.popleft()
            seq.num_computed_tokens = computed.num_tokens
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = computed.num_tokens
            if seq.first_scheduled_time is None:  # a preempted one keeps its first admission
                seq.first_scheduled_time = time.perf_counter()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen[seq] = n
            budget -= n
        return budget

    def _may_open_group(self, seq: Sequence, computed: ComputedBlocks, running: int) -> bool:
        """Admission that keeps prefix groups whole. The head of the queue and the waiting
        sequences behind it that share its prefix (a document's chunk prompts) form a group;
        if no running sequence shares that prefix, admitting the head would start the group
        beside another group's rows, and with a pool that holds about one group its other
        members would follow one at a time as the running rows finish: each decoding beside a
        batch whose prefix it does not share, its document read alone. So the head opens its
        group only when nothing else runs, or when the whole group fits now (places and KV
        blocks); it waits otherwise. The queue's order is unchanged (the prefill ideal of the
        job's depth-first order holds), and a sequence joining a running group, a group of one
        or a recompute of a preempted sequence whose group runs is admitted as before."""
        if running == 0 or len(self.waiting) < 2:
            return True
        bs = self.kv.block_size
        shared = _common_blocks(seq.token_ids, self.waiting[1].token_ids, bs)
        if shared == 0:
            return True  # a group of one
        prefix = seq.token_ids[: shared * bs]
        last = prefix[-bs:]
        for other in reversed(self.running):  # joins a running group (the newest, mostly)
            ids = other.token_ids
            if ids[(shared - 1) * bs : shared * bs] == last and ids[: shared * bs] == prefix:
                return True
        members = 1
        blocks = -(-seq.num_tokens // bs) - len(computed.block_ids)
        for other in itertools.islice(self.waiting, 1, None):
            if other.token_ids[: shared * bs] != prefix:
                break
            members += 1
            blocks += -(-other.num_tokens // bs) - shared
        return running + members <= self.max_running and blocks <= self.kv.num_free_blocks

    def _cap_long_prefill(
        self, seq: Sequence, n: int, context: int, chosen: dict[Sequence, int]
    ) -> int:
        """A prompt's chunk of n tokens after `context` computed ones, capped while this step
        carries decodes: at long_prefill_token_threshold tokens' worth of compute and, for a
        prompt longer than that threshold, at what the step cost model says keeps the step
        within its ratio of a plain decode step's time."""
        threshold = self.config.long_prefill_token_threshold
        if not threshold or n <= 1:
            return n
        cap = threshold
        c = self.config.attention_break_even_context
        if c:
            # A token at context x costs (1 + x / c) plain tokens, so n tokens after `context`
            # cost n * (1 + (context + n / 2) / c): the largest n within the cap solves
            # n^2 / 2c + n (1 + context / c) = cap.
            a = 1 + context / c
            cap = max(1, int(c * (math.sqrt(a * a + 2 * cap / c) - a)))
        if self.cost is not None and seq.num_tokens > threshold:
            timed = self.cost.chunk_cap(context)
            if timed is not None:
                cap = min(cap, timed)
        # last, since it scans the step so far: does a decode wait on this step?
        if n > cap and any(s.num_tokens - s.num_computed_tokens == 1 for s in chosen):
            return cap
        return n

    def _preempt(self, seq: Sequence) -> None:
        """Free the newest sequence's blocks; it will be recomputed from its tokens."""
        if self.running[-1] is seq:
            self.running.pop()
        else:
            self.running.remove(seq)
        self.kv.free(id(seq))
        seq.clear_drafts()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens' KV is now in the cache (drafts' KV counts
        only once accept_drafts has accepted them)."""
        for seq, n in out.chunks:
            seq.num_computed_tokens += n - len(seq.draft_token_ids)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification, with the accepted tokens appended to `seq.token_ids`: the first
        `num_accepted` drafts' KV is final; the rejected drafts' slots are released."""
        if not 0 <= num_accepted <= len(seq.draft_token_ids):
            raise ValueError(f"accepted {num_accepted} of {len(seq.draft_token_ids)} draft tokens")
        seq.num_computed_tokens += num_accepted
        seq.clear_drafts()
        self.kv.truncate(id(seq), seq.token_ids, seq.num_computed_tokens)

    @staticmethod
    def _trim_drafts(seq: Sequence, k: int) -> None:
        if k <= 0:
            seq.clear_drafts()
            return
        del seq.draft_token_ids[k:]
        if seq.draft_probs is not None:
            seq.draft_probs = seq.draft_probs[:k]

    def finish(self, finished: list[Sequence]) -> None:
        """Release finished sequences (their full blocks stay in the prefix cache)."""
        if not finished:
            return
        # with async scheduling a sequence preempted while its last token was in flight
        # finishes in the queue
        was_waiting = any(s.status is SequenceStatus.WAITING for s in finished)
        for seq in finished:
            seq.status = SequenceStatus.FINISHED
            self.kv.free(id(seq), seq.token_ids)
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        if was_waiting:
            self.waiting = deque(s for s in self.waiting if s.status is SequenceStatus.WAITING)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
        elif seq.status is SequenceStatus.RUNNING:
            self.finish([seq])


def _common_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """Full blocks two token lists share from their start, each keeping its last token out
    (the last prompt token is always computed)."""
    limit = (min(len(a), len(b)) - 1) // block_size
    n = 0
    while (
        n < limit
        and a[n * block_size : (n + 1) * block_size] == b[n * block_size : (n + 1) * block_size]
    ):
        n += 1
    return n

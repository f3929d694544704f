"""A draft model proposes k tokens per sequence, with its own paged KV cache kept in step.

The draft is any checkpoint with the target's vocabulary (engine/model/loader.py). It has its own
KVCacheManager and cache tensors (a ModelRunner of its own), and per target sequence the
list of tokens whose KV it holds. Each step, for the sequences that speculate:

    1. roll back to the longest prefix of what it computed that is still the sequence's
       (rejected drafts, or drafts that were never scheduled, are released);
    2. catch up on the tokens it has not seen (the whole prompt the first time, then the one
       or two tokens the target added) and sample d_1 from the last position;
    3. k - 1 single-token decodes, each sampling the next draft.

Greedy requests take the draft's argmax (q one-hot); sampled requests draw from the draft's
processed distribution (their own temperature, top-k, top-p, min-p) and record it as q for
the rejection sampler.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.core.sequence import Sequence
from kvbatch.engine.exec.runner import ModelRunner
from kvbatch.engine.exec.sampler import Sampler, SamplingTensors
from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.model.loader import LoadedModel, load_model
from kvbatch.engine.sched.scheduler import ScheduledChunk, SchedulerOutput

log = logging.getLogger(__name__)


class _DraftSeq:
    """What the runner reads of a sequence, for the draft's cache: `token_ids` holds the
    tokens whose KV the draft has (and the one it is about to compute)."""

    __slots__ = ("num_computed_tokens", "num_final", "token_ids")

    draft_token_ids: tuple = ()

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_final = 0  # the first num_final of token_ids were the sequence's own tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(
        self,
        path: str,
        *,
        vocab_size: int,
        tokenizer,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        device: torch.device,
        dtype: torch.dtype,
        backend,
        seed: int = 0,
        loaded: LoadedModel | None = None,  # the draft already loaded (LLMEngine sizes KV by it)
    ) -> None:
        loaded = loaded or load_model(path, dtype, device)
        if loaded.config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model {path} has a vocabulary of {loaded.config.vocab_size} tokens "
                f"but the target's has {vocab_size}: pick a draft of the same model family "
                "(the same tokenizer), or use speculative='ngram'"
            )
        if loaded.config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"the draft model {path} has a context of {loaded.config.max_position_embeddings}"
                f" tokens, shorter than max_model_len={max_model_len}: lower max_model_len"
            )
        if tokenizer is not None and loaded.tokenizer is not None:
            if tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
                raise ValueError(
                    f"the draft model {path} has another tokenizer than the target: token ids "
                    "would mean different text; pick a draft of the same model family"
                )
        self.model = loaded.model
        self.vocab_size = vocab_size
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(
            loaded.model,
            self.kv,
            num_blocks,
            block_size,
            device,
            dtype,
            backend,
            seed=seed,
            cascade=False,
        )
        self.sampler = Sampler(seed=seed + 1)
        self.device = device
        self.states: dict[Sequence, _DraftSeq] = {}

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq, None)
        if state is not None:
            self.kv.free(id(state))

    def propose(self, picks: list[tuple[Sequence, int]], step: int) -> None:
        """Set `draft_token_ids` (and `draft_probs` for sampled requests) of each picked
        sequence; a sequence whose draft cache has no room gets no drafts."""
        active: list[tuple[Sequence, _DraftSeq, int]] = []
        for seq, k in picks:
            seq.clear_drafts()
            state = self._catch_up(seq)
            if state is not None:
                active.append((seq, state, k))
        if not active:
            return
        # Round 0 catches up (1 or more tokens each); rounds 1..k-1 decode one token each.
        want_q = [not seq.params.greedy for seq, _, _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        limit = [k for _, _, k in active]
        for j in range(max(limit)):
            live = [i for i in range(len(active)) if limit[i] > j]
            if j > 0:
                for i in live:
                    if not self._grow(active[i][0], active[i][1]):
                        limit[i] = j  # draft cache full: this sequence stops at j drafts
                live = [i for i in live if limit[i] > j]
            if not live:
                break
            tokens, q = self._forward(active, live, want_q)
            for n, i in enumerate(live):
                seq, state, _ = active[i]
                state.num_computed_tokens = state.num_tokens
                state.token_ids.append(tokens[n])
                seq.draft_token_ids.append(tokens[n])
                if q is not None and want_q[i]:
                    probs[i].append(q[n])
        for i, (seq, _, _) in enumerate(active):
            if want_q[i] and probs[i]:
                seq.draft_probs = torch.stack(probs[i])

    # -- internals ------------------------------------------------------------------------

    def _catch_up(self, seq: Sequence) -> _DraftSeq | None:
        """Roll the draft's copy back to what is still true, then allocate the tokens it has
        not computed (prefix cache hits for a new sequence)."""
        final = seq.token_ids
        state = self.states.get(seq)
        if state is not None:
            # Tokens below num_final were final when last seen, so they still are; only the
            # few after them (drafts then) can differ from the sequence now.
            limit = min(state.num_computed_tokens, len(final))
            same = min(state.num_final, limit)
            while same < limit and state.token_ids[same] == final[same]:
                same += 1
            if same == len(final):  # nothing left to compute, but the last logits are needed
                self.release(seq)
                state = None
            else:
                if same < state.num_computed_tokens:
                    self.kv.truncate(id(state), final, same)
                state.num_computed_tokens = same
                ok = self.kv.allocate_slots(id(state), final, len(final) - same)
        if state is None:
            state = self.states[seq] = _DraftSeq()
            computed = self.kv.get_computed_blocks(final)  # leaves the last token to compute
            ok = self.kv.allocate_slots(
                id(state), final, len(final) - computed.num_tokens, computed
            )
            state.num_computed_tokens = computed.num_tokens
        if not ok:
            log.debug("draft KV cache full: no drafts for %s this step", seq.request_id)
            self.release(seq)
            return None
        state.token_ids = list(final)
        state.num_final = len(final)
        return state

    def _grow(self, seq: Sequence, state: _DraftSeq) -> bool:
        """One more slot for the next draft token (the drafts are never hashed)."""
        return self.kv.allocate_slots(id(state), seq.token_ids, 1)

    def _forward(self, active, live, want_q):
        chunks = [
            ScheduledChunk(active[i][1], active[i][1].num_tokens - active[i][1].num_computed_tokens)
            for i in live
        ]
        order = sorted(range(len(live)), key=lambda n: chunks[n].num_new_tokens > 1)
        chunks = [chunks[n] for n in order]  # the runner wants single-token chunks first
        runner = self.runner
        input_ids, meta, rows, _ = runner._prepare(SchedulerOutput(chunks, 0))
        logits = runner._forward(runner._graph_key(input_ids, meta, rows), input_ids, meta, rows)
        inverse = [0] * len(order)
        for pos, n in enumerate(order):
            inverse[n] = pos
        logits = logits[torch.tensor(inverse, device=logits.device)]  # back to `live` order
        params = [active[i][0].params for i in live]
        if not any(want_q[i] for i in live):
            return logits.argmax(dim=-1).tolist(), None
        # Seeded requests draw their drafts from (seed ^ salt, offset): reproducible in any
        # batch, and independent of the noise the rejection sampler draws from (seed, offset).
        params = [p if p.seed is None else _salted(p) for p in params]
        offsets = [active[i][1].num_tokens - len(active[i][0].prompt_token_ids) for i in live]
        t = SamplingTensors.from_params(params, offsets, self.vocab_size, self.device)
        q = self.sampler.processed_probs(logits, t)  # [live, V]
        tokens = (q / self.sampler.noise(q, t)).argmax(dim=-1)
        tokens = torch.where(t.temperature == 0, logits.argmax(dim=-1), tokens)
        return tokens.tolist(), q


_DRAFT_SALT = 0x5DEECE66D


@functools.lru_cache(maxsize=1024)
def _salted(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, seed=params.seed ^ _DRAFT_SALT)

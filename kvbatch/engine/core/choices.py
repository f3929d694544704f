"""n > 1: one prompt, n choices that share the prompt's KV blocks.

A request with n choices is n sequences. Choice 0 is the request's own sequence and is
scheduled like any other; choices 1..n-1 wait until choice 0 has computed the prompt (its
first token arrives), then *fork*: the KV manager gives each child the prompt's full blocks
(reference counted, KVCacheManager.fork) and the child joins the running batch having only
the prompt's last, partly filled block to compute. If choice 0 no longer holds its blocks by
then (it finished with its pending last token, or was preempted), or the running batch is at
max_num_seqs, the children are queued as new sequences and find the prompt in the prefix
cache instead.

Each choice samples from its own seed stream: choice i uses seed + i (mod 2**63) when the
request has a seed, so choice 0 is exactly what the same request with n = 1 returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.engine.core.sequence import ChoiceGroup, Sequence
from kvbatch.engine.kv.kv_cache import KVCacheManager
from kvbatch.engine.sched.scheduler import Scheduler

SEED_MODULUS = 2**63


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s own params: n = 1 and its seed stream."""
    seed = None if params.seed is None else (params.seed + index) % SEED_MODULUS
    return dataclasses.replace(params, n=1, seed=seed)


def make_choices(seq: Sequence, prepare: Callable[[Sequence], None]) -> None:
    """Give `seq` (choice 0, n > 1) its n - 1 sibling sequences, each passed to `prepare`
    (grammar, speculation) as the engine prepares any sequence."""
    n = seq.params.n
    children = [
        Sequence(seq.request_id, seq.prompt_token_ids, choice_params(seq.params, i), seq.prompt)
        for i in range(1, n)
    ]
    group = ChoiceGroup([seq, *children])
    for i, s in enumerate(group.seqs):
        s.choice_index, s.choices = i, group
    for child in children:
        prepare(child)


def needs_fork(seq: Sequence) -> bool:
    """Choice 0 of a group whose children have not started yet."""
    group = seq.choices
    return group is not None and not group.forked and seq.choice_index == 0


def fork_choices(seq: Sequence, kv: KVCacheManager, scheduler: Scheduler) -> None:
    """Start choice 0's children, sharing the full blocks of its prompt (see module doc)."""
    group = seq.choices
    group.forked = True
    # The last prompt token is recomputed by each child: its logits give the child's first
    # token, and its block is the partly filled one.
    num_shared = seq.num_prompt_tokens - 1
    room = scheduler.max_running - len(scheduler.running)
    for child in group.seqs[1:]:
        # Past the running cap a child queues as a new sequence (the prefix cache serves it).
        shared = kv.fork(id(seq), id(child), num_shared) if room > 0 else 0
        room -= 1
        if shared:
            child.num_cached_tokens = shared
            scheduler.add_forked(child, shared)
        else:
            scheduler.add(child)

"""Speculative decoding: proposers guess k tokens, the target verifies them in one forward.

    ngram.py      n-gram prompt lookup (no model): the sequence's own earlier tokens
    draft.py      a small draft model with its own paged KV cache, kept in step
    rejection.py  the rejection sampler that keeps outputs exactly the target's distribution
    decoder.py    per-step policy: who speculates, how many tokens, acceptance tracking
    stats.py      acceptance counters (per request and for the engine)

The scheduler gives a speculating sequence one chunk of 1 + k tokens (its last sampled token
and the drafts, kept in `Sequence.draft_token_ids`, never in `token_ids`); the runner scores
all 1 + k positions in the step's single forward; the rejection sampler accepts a prefix of
the drafts and adds one token of its own; the KV slots of rejected drafts are released.
"""

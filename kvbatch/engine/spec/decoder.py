"""Per-step speculation policy: who proposes how many tokens, and what acceptance was.

Speculation pays when verifying 1 + k tokens costs about as much as decoding one, which holds
while a step is memory-bound (small decode batches) and the drafts are often right. So:

- no sequence speculates in a step with more than `max_batch_size` decodes (compute-bound);
- a sequence whose acceptance (EWMA of accepted / proposed per verification) falls below
  `min_acceptance` decodes normally for `backoff_steps` steps, then tries again;
- the larger the decode batch, the higher the acceptance a sequence needs to speculate
  (linear from `min_acceptance` at batch 1 to `large_batch_acceptance` at `max_batch_size`):
  on the CPU with SmolLM2, verification won 1.4x at batch 16 with 90% acceptance but lost
  ~15% there at 45%;
- k never runs past max_tokens or max_model_len (the target adds one token of its own);
- an n-gram sequence with no match simply decodes.
"""

from __future__ import annotations

from kvbatch.engine.core.config import SpecConfig
from kvbatch.engine.core.sequence import Sequence, SequenceStatus
from kvbatch.engine.spec.stats import SpecDecodeStats


class SpecDecoder:
    def __init__(self, config: SpecConfig, proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()  # the engine's totals

    def propose(self, running: list[Sequence], step: int) -> int:
        """Give drafts to the running decodes that should speculate this step; returns how
        many sequences were asked to propose."""
        c = self.config
        decodes = [
            s
            for s in running
            if s.status is SequenceStatus.RUNNING and s.num_tokens - s.num_computed_tokens == 1
        ]
        if not decodes or len(decodes) > c.max_batch_size:
            return 0
        span = max(1, c.max_batch_size - 1)
        need = c.min_acceptance + (c.large_batch_acceptance - c.min_acceptance) * min(
            1.0, (len(decodes) - 1) / span
        )
        picks = []
        for seq in decodes:
            if seq.spec_resume_step > step or seq.spec_acceptance < need:
                continue
            room = min(
                seq.params.max_tokens - seq.num_output_tokens,
                self.max_model_len - seq.num_tokens,
            )
            k = min(c.num_speculative_tokens, room - 1)
            if k > 0:
                picks.append((seq, k))
        if picks:
            self.proposer.propose(picks, step)
        return len(picks)

    def observe(
        self, seq: Sequence, num_drafts: int, num_accepted: int, num_used: int, step: int
    ) -> None:
        """Record one verification of `seq` (`num_accepted` of `num_drafts` accepted, of which
        `num_used` reached the output: a stop may cut the rest) and switch its speculation
        off if it does not pay."""
        if seq.spec_stats is None:
            seq.spec_stats = SpecDecodeStats()
        seq.spec_stats.record(num_drafts, num_used)
        self.stats.record(num_drafts, num_used)
        c = self.config
        rate = num_accepted / num_drafts
        seq.spec_acceptance = c.acceptance_decay * rate + (1 - c.acceptance_decay) * (
            seq.spec_acceptance
        )
        if seq.spec_acceptance < c.min_acceptance:
            seq.spec_resume_step = step + 1 + c.backoff_steps
            seq.spec_acceptance = 1.0  # a fresh start when it tries again

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: drop what the proposer keeps for it."""
        seq.clear_drafts()
        self.proposer.release(seq)


def build_spec_decoder(config: SpecConfig, engine, draft=None) -> SpecDecoder:
    """The proposer of `config.method` for an LLMEngine (after its KV cache is sized);
    `draft`: the draft model, when the engine loaded it already (kvbatch.engine.model.loader.LoadedModel)."""
    if config.method == "ngram":
        from kvbatch.engine.spec.ngram import NgramProposer

        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    else:
        from kvbatch.engine.spec.draft import DraftModelProposer

        proposer = DraftModelProposer(
            config.draft_model,
            vocab_size=engine.model_config.vocab_size,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            num_blocks=engine.kv.num_blocks,
            block_size=engine.kv.block_size,
            enable_prefix_caching=engine.kv.enable_prefix_caching,
            device=engine.device,
            dtype=engine.dtype,
            backend=engine.runner.backend,
            seed=engine.config.seed,
            loaded=draft,
        )
    return SpecDecoder(config, proposer, engine.max_model_len)

"""`SpecConfig`: speculative decoding's settings. Plain Python, no torch: `LLM`'s `speculative`
keyword takes one, so EngineArgs (args.py) names its type."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SPEC_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: who proposes tokens, how many, and when it switches itself off.

    `method` "ngram" looks the sequence's last tokens up in its own prompt and output; "draft"
    runs `draft_model` (a checkpoint with the target's vocabulary). Speculation is decided per
    sequence and per step: a sequence whose acceptance (an EWMA of accepted / proposed) falls
    below `min_acceptance` decodes normally for `backoff_steps` steps, then tries again; the
    acceptance a sequence needs grows with the step's decode batch (to `large_batch_acceptance`
    at `max_batch_size`), since verification costs more there; and no sequence speculates in a
    step whose decode batch is larger than `max_batch_size` (the step is compute-bound there,
    and verifying k extra tokens per sequence costs more than it saves).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    ngram_min: int = 2  # shortest n-gram looked up
    ngram_max: int = 4  # longest n-gram looked up (longest match wins)
    min_acceptance: float = 0.25  # needed at batch 1; backoff below it
    large_batch_acceptance: float = 0.6  # needed at max_batch_size (linear in between)
    acceptance_decay: float = 0.5  # EWMA weight of the newest step's acceptance
    backoff_steps: int = 16
    # Decodes per step above which nobody speculates: verification pays at small batches and
    # stops paying near 32 (`kvbatch bench spec-copy`; docs/BENCHMARKS.md), so 16 keeps a
    # large batch as fast as without speculation.
    max_batch_size: int = 16

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not known; use 'ngram' or 'draft:PATH'"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs a draft model: 'draft:PATH'")
        if self.method == "ngram" and self.draft_model is not None:
            raise ValueError("draft_model is only used with method 'draft'")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}"
            )
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if not 0.0 <= self.large_batch_acceptance <= 1.0:
            raise ValueError(
                f"large_batch_acceptance must be in [0, 1], got {self.large_batch_acceptance}"
            )
        if not 0.0 < self.acceptance_decay <= 1.0:
            raise ValueError(f"acceptance_decay must be in (0, 1], got {self.acceptance_decay}")
        if self.backoff_steps < 0:
            raise ValueError(f"backoff_steps must be >= 0, got {self.backoff_steps}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    @classmethod
    def parse(
        cls, value: str | SpecConfig | None, num_speculative_tokens: int | None = None
    ) -> SpecConfig | None:
        """`"ngram"`, `"draft:PATH"`, a SpecConfig or None (off); `num_speculative_tokens`
        overrides k when given."""
        if value is None:
            if num_speculative_tokens is not None:
                raise ValueError("num_speculative_tokens needs speculative='ngram' or 'draft:PATH'")
            return None
        if isinstance(value, SpecConfig):
            config = value
        elif isinstance(value, str):
            method, _, path = value.partition(":")
            if method == "ngram" and not path:
                config = cls("ngram")
            elif method == "draft" and path:
                config = cls("draft", draft_model=path)
            else:
                raise ValueError(
                    f"speculative={value!r}: expected 'ngram' or 'draft:PATH' "
                    "(PATH a Hugging Face folder or .gguf with the target's vocabulary)"
                )
        else:
            raise ValueError(
                f"speculative must be None, 'ngram', 'draft:PATH' or a SpecConfig, "
                f"not {type(value).__name__}"
            )
        if num_speculative_tokens is not None:
            config = dataclasses.replace(config, num_speculative_tokens=num_speculative_tokens)
        return config

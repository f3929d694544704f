"""Prefill accounting of the generation job: what the engine computed against the ideal.

The ideal is what `kvbatch.jobs.grouping` computes for the job's order: each distinct prefix
once, in full cache blocks, capped like the engine's hits (the last prompt token is always
computed). For an index job that is each document once, plus each chunk and instruction:
the promise the run checks and reports. The prompts are tokenized as run_job tokenizes them
(chat template included), so the counts are of the same tokens."""

from __future__ import annotations

from kvbatch.index.report import PrefillTokens
from kvbatch.index.stage_jobs import StageAnswers
from kvbatch.jobs.grouping import group_by_prefix
from kvbatch.jobs.openai_format.prompts import PromptError, prompt_token_ids
from kvbatch.jobs.openai_format.validate import JobRequest, read_lines, validate_lines
from kvbatch.jobs.storage import Storage


def prefill_tokens(input_file: Storage, engine, answers: StageAnswers) -> PrefillTokens:
    """`computed` from the answers' usage (prompt tokens less cached tokens); `ideal` and
    `no_sharing` from the job's prompts, over the lines that were answered."""
    prompts = []
    with input_file.open_read() as f:
        for item in validate_lines(read_lines(f)):
            if not isinstance(item, JobRequest) or item.custom_id not in answers.bodies:
                continue
            try:
                prompts.append(prompt_token_ids(item, engine.tokenizer, engine.max_model_len))
            except PromptError:
                continue
    order = group_by_prefix(prompts, engine.config.cache.block_size)
    return PrefillTokens(
        computed=answers.prompt_tokens - answers.cached_tokens,
        ideal=order.prompt_tokens - order.ideal_cached_tokens,
        no_sharing=order.prompt_tokens,
    )

"""What `kvbatch run` is asked to do (RunOptions), what it raises when it cannot, and what
a run's answers depend on (job_identity, which --resume compares)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class JobError(Exception):
    """The job could not run at all (nothing was answered)."""


class JobInterrupted(JobError):
    """Ctrl-C: the message says whether answers were kept for `--resume`."""


class RunMonitor(Protocol):
    """What watches a run from outside (`kvbatch run --metrics-port`): the engine between
    its steps, and every output it finishes. Must not raise."""

    def step(self, engine) -> None: ...

    def output(self, out) -> None: ...


@dataclass
class RunOptions:
    input: str
    model: str
    output: str | None = None  # default: <input stem>.output.jsonl beside a local input
    errors: str | None = None  # default: <output stem>.errors.jsonl beside the output
    model_name: str | None = None  # the job's model name; default: the first line's "model"
    resume: bool = False
    window: int = 0  # requests inside the engine at once; 0 = 4 x max_num_seqs
    work_dir: str | None = None  # where the resumable partial output lives
    engine: dict = field(default_factory=dict)  # engine.LLM keyword arguments
    # reads tool calls out of chat answers with tool_choice "auto" (kvbatch.jobs.openai_format.tool_parsers)
    tool_call_parser: str | None = None
    monitor: RunMonitor | None = None  # metrics; changes no answer
    # processes that validate and tokenize a long job's lines (kvbatch.jobs.local.line_pool);
    # None: KVBATCH_TOKENIZE_WORKERS, else every core; 1: none. Changes no answer.
    tokenize_workers: int | None = None


def job_identity(opts: RunOptions) -> dict:
    """What a run's answers depend on besides the input lines (those are digested one by one):
    the model and the settings that change its outputs. `--resume` refuses a partial output
    whose identity differs."""
    engine = {k: opts.engine[k] for k in _OUTPUT_SETTINGS if opts.engine.get(k) is not None}
    identity = {"model": opts.model, "model_name": opts.model_name, **engine}
    if opts.tool_call_parser is not None:  # absent when unset: older partials stay resumable
        identity["tool_call_parser"] = opts.tool_call_parser
    return identity


# Engine settings that change the answers (the rest change only speed).
_OUTPUT_SETTINGS = (
    "revision",
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "max_model_len",
    "speculative",
    "reasoning_parser",
)

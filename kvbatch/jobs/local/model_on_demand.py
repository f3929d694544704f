"""The job's model, loaded only when a line needs it: `kvbatch run` validates and tokenizes
every line first, and a job where no line can run never loads the weights."""

from __future__ import annotations

import logging
from pathlib import Path

from kvbatch.hub import ModelNotFoundError, resolve_model, split_hub_id
from kvbatch.jobs.context_flags import as_flags
from kvbatch.jobs.job_context import engine_settings
from kvbatch.jobs.local.options import JobError, RunOptions

log = logging.getLogger("kvbatch.run")


def warn_missing_model(model: str) -> None:
    """A mistyped --model would otherwise go unsaid when no line needed the model."""
    if Path(str(model)).expanduser().exists():
        return
    try:
        split_hub_id(str(model))
    except ModelNotFoundError as e:
        log.warning("%s; no line needed it this time", e)


class ModelNotLoaded(JobError):
    """The model failed to load."""


class ModelOnDemand:
    """The job's model: what the validation pass asks of it (`tokenizer`, `max_model_len`),
    then the engine that runs the lines.

    With --max-model-len unset (and no `llm` given) the job picks the context (`job_first`,
    kvbatch.jobs.job_context): lines are judged against the model's own context, read with the
    tokenizer but without the weights, and the engine loads afterwards at the job's
    `longest_request` (set by the caller). Otherwise the engine loads the first time a line
    needs its tokenizer, and lines are judged against its context."""

    def __init__(self, opts: RunOptions, llm=None) -> None:
        self._opts, self._llm = opts, llm
        self.job_first = llm is None and not opts.engine.get("max_model_len")
        self.longest_request = 0
        self._files: GivenModel | None = None  # job_first: the tokenizer and the model's context

    @property
    def loaded(self) -> bool:
        return self._llm is not None

    @property
    def engine(self):
        if self._llm is None:
            from kvbatch.engine import LLM  # torch is imported here, once a line can run

            try:
                longest = self.longest_request if self.job_first else 0
                settings = engine_settings(self._opts.engine, longest)
                self._llm = LLM(model=self._opts.model, **settings)
            except (OSError, ValueError) as e:
                raise ModelNotLoaded(f"cannot load the model: {as_flags(str(e))}") from e
        return self._llm.engine

    @property
    def tokenizer(self):
        files = self._model_files()
        tokenizer = self.engine.tokenizer if files is None else files.tokenizer
        if tokenizer is None:
            raise JobError(f"the model {self._opts.model} has no tokenizer: jobs need one")
        return tokenizer

    @property
    def max_model_len(self) -> int:
        files = self._model_files()
        return self.engine.max_model_len if files is None else files.max_model_len

    def given(self) -> GivenModel | None:
        """The tokenizer and context read without the weights, once a line has needed them
        (job_first); else None: a process holding the engine (maybe a GPU's context) is not
        one to fork a pool of tokenizing processes from (kvbatch.jobs.local.line_pool)."""
        return self._files if self.job_first else None

    def _model_files(self) -> GivenModel | None:
        """job_first: the tokenizer and the model's own context, read once without the
        weights (a Hub id's configs and tokenizer are fetched, as `kvbatch submit` does). A
        model they cannot be read of loads its engine first instead, whose error (or success:
        a config only the engine understands) is the word on it."""
        if self.job_first and self._files is None:
            from kvbatch.jobs import model_info  # imports torch: once a line can run

            try:
                path = resolve_model(
                    self._opts.model, self._opts.engine.get("revision"), tokenizer_only=True
                )
                tokenizer = model_info.load_tokenizer(path)
                self._files = GivenModel(tokenizer, model_info.max_model_len(path, None, tokenizer))
            except Exception as e:  # whatever transformers raised: the engine tries next
                log.debug("reading %s without its weights failed (%s)", self._opts.model, e)
                self.job_first = False
        return self._files if self.job_first else None


class GivenModel:
    """A tokenizer and context length known beforehand (`kvbatch submit` reads them without
    loading the weights)."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len

    def given(self) -> GivenModel:
        return self

"""One endpoint per job: a line whose url cannot share the job's engine run is an error.

An OpenAI batch is created for one endpoint. kvbatch keeps that rule where it matters: chat
and completions lines both generate text and may share a job (as before), and score and
rerank lines both score pairs and may share one, but embeddings, scoring and generation do not
mix. The job's endpoint is the first valid line's; a line of the other
kind becomes one `invalid_url` error record (the rest of the job still runs, as every bad
line in kvbatch does, where OpenAI would fail the whole file at validation).
"""

from __future__ import annotations

from kvbatch.jobs.openai_format.schemas import CHAT_URL
from kvbatch.jobs.openai_format.validate import JobRequest, LineError


class EndpointRule:
    """Remembers the job's endpoint kind from its first valid line."""

    def __init__(self) -> None:
        self.first: JobRequest | None = None

    @property
    def endpoint(self) -> str:
        """The job's endpoint for batch.json: the first valid line's url; chat completions
        for a job without one (empty, or every line bad), since openai's Batch requires one."""
        return CHAT_URL if self.first is None else self.first.url

    def check(self, req: JobRequest) -> LineError | None:
        """None when `req` fits the job; else its error record, saying what to do."""
        if self.first is None:
            self.first = req
            return None
        if _kind(req) == _kind(self.first):
            return None
        return LineError(
            req.line,
            req.custom_id,
            "invalid_url",
            f"line {req.line}: url {req.url!r} does not fit this job, whose first request "
            f"(line {self.first.line}) is {_kind(self.first)} ({self.first.url}): a batch has "
            f"one endpoint; put the {_kind(req)} lines in a job of their own",
        )


def _kind(req: JobRequest) -> str:
    """What the engine does for the line: lines of one kind share a job."""
    if req.is_embedding:
        return "embeddings"
    return "scoring" if req.is_score else "text generation"

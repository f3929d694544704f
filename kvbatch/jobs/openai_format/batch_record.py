"""batch.json: an OpenAI-style batch object for a job run by kvbatch (it validates as
`openai.types.Batch` in every state).

Status follows OpenAI: a job with at least one line that passed validation is `completed`,
however many of its requests then failed (their records are in errors.jsonl, as OpenAI's error
file); a job where nothing could run (an empty file, every line bad) is `failed`, its `errors`
listing the first line errors ({code, message, line, param}) as OpenAI lists a file's
validation errors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_BATCH_ERRORS = 100
"""Line errors that batch.json's `errors` shows for a job that failed (all are in errors.jsonl)."""

STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "cancelling",
    "cancelled",
    "expired",
)


@dataclass
class BatchRecord:
    id: str
    input_uri: str
    output_uri: str
    errors_uri: str
    model: str
    status: str = "validating"
    endpoint: str = "/v1/chat/completions"  # the job's (kvbatch.jobs.openai_format.endpoint)
    created_at: int = field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    vectors: int = 0  # of an embeddings job: what `kvbatch run` reports (batch.json has none)
    errors: list[dict] = field(default_factory=list)  # OpenAI BatchError objects

    @classmethod
    def start(
        cls, *, batch_id: str, input_uri: str, output_uri: str, errors_uri: str, model: str
    ) -> BatchRecord:
        return cls(batch_id, input_uri, output_uri, errors_uri, model)

    def mark_in_progress(self) -> None:
        self.status, self.in_progress_at = "in_progress", int(time.time())

    def mark_finalizing(self) -> None:
        self.status, self.finalizing_at = "finalizing", int(time.time())

    def add_usage(self, usage: dict) -> None:
        self.prompt_tokens += usage["prompt_tokens"]
        self.completion_tokens += usage.get("completion_tokens", 0)  # none for embeddings
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def finish(
        self, *, completed: int, failed: int, ran: int, samples: Iterable[dict] = ()
    ) -> None:
        """Counts and final status. `ran`: the lines that passed validation (answered or
        failed while running). `samples`: error records' `error` objects, shown in `errors`
        when no line could run."""
        self.completed, self.failed, self.total = completed, failed, completed + failed
        if completed or ran:
            self.status, self.completed_at = "completed", int(time.time())
            return
        self.status, self.failed_at = "failed", int(time.time())
        self.errors = [
            {"code": e["code"], "message": e["message"], "line": e.get("line"), "param": None}
            for e in samples
        ] or [
            {
                "code": "empty_file",
                "message": "the input file holds no requests: give one JSON request per line",
                "line": None,
                "param": None,
            }
        ]

    def mark_cancelled(self, *, cancelling_at: int, at: int) -> None:
        """A finished job that was cancelled: OpenAI's cancelled batches have no completed_at."""
        self.status, self.completed_at = "cancelled", None
        self.failed_at, self.errors = None, []  # nothing answered: cancelled, not failed
        self.cancelling_at, self.cancelled_at = cancelling_at, at

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_uri,
            "completion_window": "24h",
            "status": self.status,
            "output_file_id": self.output_uri,
            "error_file_id": self.errors_uri,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": None,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": None,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "usage": {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
            "metadata": {"model": self.model},
        }

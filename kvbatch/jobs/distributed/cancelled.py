"""The cancel marker and the record of a line that a cancel left unanswered.

    <job>/cancel   {"at": time}, written once by `kvbatch cancel`

Finalize, the shard runner and `kvbatch cancel` all need these; they live here, below all
three, so that none of them imports another to get them.
"""

from __future__ import annotations

from kvbatch.jobs.openai_format.responses import error_line
from kvbatch.jobs.openai_format.validate import LineError
from kvbatch.jobs.storage import Storage

CANCEL_MARKER = "cancel"
CANCELLED = "batch_cancelled"  # the error code of a line a cancel left unanswered


def cancel_requested(job: Storage) -> bool:
    """Whether `kvbatch cancel` was asked for this job (its marker exists)."""
    return job.join(CANCEL_MARKER).exists()


def cancelled_message(line: int) -> str:
    return f"line {line}: the batch was cancelled before this request was answered"


def cancelled_line(line: int, custom_id: str, *, batch_id: str) -> dict:
    """The error line of a request that a cancel left unanswered."""
    return error_line(
        LineError(line, custom_id, CANCELLED, cancelled_message(line)), batch_id=batch_id
    )

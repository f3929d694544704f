"""Names and settings that the Celery app, the shard task and `kvbatch resend` share: the task's
name, the default queue, the broker URL and the visibility timeout. Plain Python, no Celery, so
the task module and the app module both build on it without importing each other.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from kvbatch.redact import redact_url

TASK_NAME = "kvbatch.run_shard"
DEFAULT_QUEUE = "kvbatch"
# Redis' kombu default is 1 h. A shard of 200k tokens takes minutes on a GPU; 2 h leaves a
# wide margin. A killed worker's shard waits this long before another worker gets it.
DEFAULT_VISIBILITY_TIMEOUT = 2 * 3600
SCHEMES = ("redis://", "rediss://", "sqs://")


class BrokerError(ValueError):
    """No usable broker URL was given."""


def broker_url(flag: str | None = None) -> str:
    """The broker URL from `--broker` or else KVBATCH_BROKER_URL; the scheme is checked."""
    url = flag or os.environ.get("KVBATCH_BROKER_URL")
    if not url:
        raise BrokerError("no broker: give --broker URL or set KVBATCH_BROKER_URL")
    if not url.startswith(SCHEMES):
        raise BrokerError(f"broker URL {redact_url(url)!r}: expected one of {', '.join(SCHEMES)}")
    try:
        _ = urlsplit(url).port  # kombu and Celery parse it: what fails them fails here
    except ValueError as e:
        raise BrokerError(f"broker URL {redact_url(url)!r} is malformed ({e}): fix it") from None
    return url


def visibility_timeout() -> int:
    """Seconds before an unacknowledged shard is handed out again (KVBATCH_VISIBILITY_TIMEOUT)."""
    raw = os.environ.get("KVBATCH_VISIBILITY_TIMEOUT")
    if raw is None:
        return DEFAULT_VISIBILITY_TIMEOUT
    try:
        value = int(raw)
    except ValueError:
        raise BrokerError(f"KVBATCH_VISIBILITY_TIMEOUT={raw!r}: expected whole seconds") from None
    if value <= 0:
        raise BrokerError(f"KVBATCH_VISIBILITY_TIMEOUT={raw!r}: must be positive")
    return value


def task_events() -> bool:
    """Whether workers send task events (KVBATCH_TASK_EVENTS: 1/true/yes or 0/false/no)."""
    raw = os.environ.get("KVBATCH_TASK_EVENTS", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise BrokerError(f"KVBATCH_TASK_EVENTS={raw!r}: expected 1 or 0 (true or false)")

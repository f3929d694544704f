"""Numbers read from the environment, checked as the flags are: a bad value is a message that
names the variable and what it takes, never a traceback from int() deep in a shard."""

from __future__ import annotations

import os


class SettingError(ValueError):
    """An environment variable holds a value kvbatch cannot use."""


def env_number(
    name: str,
    default: int | float,
    *,
    kind: type[int] | type[float] = int,
    minimum: int | float | None = None,
    unit: str = "",
) -> int | float:
    """`name`'s value as `kind` (default when unset or empty), at least `minimum`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    what = ("a whole number" if kind is int else "a number") + (f" of {unit}" if unit else "")
    try:
        value = kind(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r}: expected {what}") from None
    if value != value or value in (float("inf"), float("-inf")):  # nan, inf
        raise SettingError(f"{name}={raw!r}: expected {what}")
    if minimum is not None and value < minimum:
        raise SettingError(
            f"{name}={raw!r}: must be at least {minimum}{' ' + unit if unit else ''}"
        )
    return value

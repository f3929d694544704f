"""How a user's value is quoted in an error message: its repr, cut to fit on the line."""

from __future__ import annotations


def shown(value: object, limit: int = 60) -> str:
    """repr(value), at most `limit` characters (cut ones end in "...")."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

"""How a load error lists a checkpoint's tensor names: the first few, then "..."."""

from __future__ import annotations

from collections.abc import Sequence


def some_names(names: Sequence[str], limit: int = 3) -> str:
    """The first `limit` names, comma-separated, with " ..." when there are more."""
    return ", ".join(names[:limit]) + (" ..." if len(names) > limit else "")

"""kvbatch's cache folder ($KVBATCH_CACHE, else ~/.cache/kvbatch): fetched model wheels, the
offline harmony vocabulary, resumable partial outputs. Neutral: it imports nothing of kvbatch,
so every layer may use it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "KVBATCH_CACHE"


def resolve_cache_dir(cache_dir: Path | str | None = None) -> Path:
    """The cache folder: `cache_dir`, else $KVBATCH_CACHE, else ~/.cache/kvbatch (created)."""
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvbatch"
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root

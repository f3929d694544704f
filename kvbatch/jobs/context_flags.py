"""The engine's errors name its Python keywords (max_model_len=..., kv_cache_bytes); a job runs
from the command line, where the same settings are flags. Messages shown to a job's user go
through `as_flags`, and a line too long for a context the engine capped at its KV cache is
told which flags would admit it (`long_line_advice`)."""

from __future__ import annotations

import re

# keyword -> flag, for the settings a context-length message names
_FLAGS = {
    "max_model_len": "--max-model-len",
    "kv_cache_bytes": "--kv-cache-bytes",
    "kv_cache_memory_fraction": "--kv-cache-memory-fraction",
}
_KEYWORD = re.compile(r"\b(" + "|".join(_FLAGS) + r")\b(=)?")
_NO_FLAG = re.compile(r"\bnum_kv_blocks(, or |, )?")  # a Python-only setting: dropped


def as_flags(message: str) -> str:
    """`message` with the engine's keywords as command-line flags (`max_model_len=64` reads
    `--max-model-len 64`); a keyword that has no flag is left out."""
    message = _NO_FLAG.sub("", message)
    return _KEYWORD.sub(lambda m: _FLAGS[m.group(1)] + (" " if m.group(2) else ""), message)


def long_line_advice(engine) -> str:
    """What would admit a line too long for a context the engine capped at its KV cache, in
    flags ("" when the engine runs the model's whole context; an encoder never caps)."""
    advice = getattr(engine, "context_advice", None)
    return as_flags(advice()) if advice is not None else ""

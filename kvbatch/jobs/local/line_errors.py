"""A job's validation errors, spilled to disk in line order: a job whose every line is bad
(a million of them) keeps eight bytes an error in memory, not the error.

The message of an error of one kind can gain advice learned after the pass (`advise`: the
flags that would admit a line longer than the context the engine was capped at), added as the
errors are read back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from kvbatch.jobs.local.spill import SpillFile
from kvbatch.jobs.openai_format.validate import LineError


class LineErrors:
    def __init__(self, folder: str | Path | None = None) -> None:
        self._spill = SpillFile(folder, prefix="kvbatch-errors-")
        self._advice: dict[str, str] = {}

    def append(self, error: LineError) -> None:
        fields = [error.line, error.custom_id, error.code, error.message]
        self._spill.append(json.dumps(fields, ensure_ascii=False).encode())

    def advise(self, code: str, advice: str) -> None:
        """Add `advice` to the message of every error of `code` (as they are read)."""
        self._advice[code] = self._advice.get(code, "") + advice

    def __len__(self) -> int:
        return len(self._spill)

    def __iter__(self) -> Iterator[LineError]:
        for i in range(len(self._spill)):
            line, custom_id, code, message = json.loads(self._spill[i])
            yield LineError(line, custom_id, code, message + self._advice.get(code, ""))

    def close(self) -> None:
        self._spill.close()

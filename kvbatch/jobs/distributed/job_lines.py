"""The lines of a job being submitted, in memory that does not grow with their text.

`kvbatch submit` reads its input twice. The first pass (`scan_input`) validates and tokenizes
each line, spills its token ids to a TokenStore (on disk), writes a bad line's error record to a
spill file, and keeps only a row of integers per answered line (`LineTable`): where the line
lies in the input, its line number, its token-store entries and its prompt tokens. The prefix
trie (kvbatch.jobs.grouping) sees the prompts as they pass and keeps their block hashes. The
second pass (`read_request`) reads one line again by its byte offset, validates it again and
takes its token ids back from the store, for the shard being written only.

Per answered line that is 5 integers (40 bytes), the trie's hashes and validate_lines' set of
custom_ids; the line's text, its JobRequest and its token list are gone once it is read.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kvbatch.jobs.local.options import JobError, RunOptions
from kvbatch.jobs.local.prepare import JobTraits, PreparedLine, scan_lines
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.openai_format.prompts import sampling_params_for
from kvbatch.jobs.openai_format.responses import error_line
from kvbatch.jobs.openai_format.validate import JobRequest, LineError, validate_lines
from kvbatch.jobs.storage import LocalStorage, Storage, StorageError


@dataclass
class LineTable:
    """A row of integers per answered line (a unit: an embeddings line's inputs are one), in
    input order: unit u is the u-th answered line."""

    line: array = field(default_factory=lambda: array("q"))  # 1-based input line
    offset: array = field(default_factory=lambda: array("q"))  # byte offset in the input
    size: array = field(default_factory=lambda: array("q"))  # bytes
    entry: array = field(default_factory=lambda: array("q"))  # first token-store entry
    tokens: array = field(default_factory=lambda: array("q"))  # prompt tokens, all inputs

    def add(self, item: PreparedLine, entry: int) -> None:
        self.line.append(item.line)
        self.offset.append(item.offset)
        self.size.append(item.size)
        self.entry.append(entry)
        self.tokens.append(sum(len(ids) for ids in item.inputs))

    def __len__(self) -> int:
        return len(self.line)


class ScanProgress:
    """`kvbatch submit: tokenized 120,000 lines (12% of 1.7 GB), 2,310 lines/s, about 6 min
    left` on stderr every `every_seconds`, and once at the end (the ETA from the bytes read)."""

    def __init__(
        self,
        total_bytes: int | None,
        every_seconds: float = 10.0,
        write: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total_bytes
        self.every = every_seconds
        self.write = write or (lambda m: print(m, file=sys.stderr, flush=True))
        self.clock = clock
        self.start = self.last = clock()
        self.lines = 0

    def update(self, lines: int, bytes_read: int) -> None:
        self.lines = lines
        now = self.clock()
        if now - self.last >= self.every:
            self.last = now
            self.write(self.line(bytes_read, now))

    def line(self, bytes_read: int, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        text = f"kvbatch submit: tokenized {self.lines:,} lines"
        if self.total:
            text += f" ({100 * bytes_read / self.total:.0f}% of {_size(self.total)})"
        text += f", {self.lines / elapsed:,.0f} lines/s"
        if self.total and bytes_read:
            left = elapsed * (self.total - bytes_read) / bytes_read
            text += f", about {_duration(left)} left"
        return text

    def done(self, bytes_read: int) -> None:
        now = self.clock()
        if now - self.start >= self.every:  # a job that took a while says how it ended
            took = _duration(now - self.start)
            self.write(self.line(bytes_read, now).split(", about")[0] + f", done in {took}")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@dataclass
class ScannedInput:
    """What the first pass leaves: the table of answered lines, the error records' spill file
    and the job's traits."""

    table: LineTable
    errors_path: Path
    num_errors: int
    traits: JobTraits


def local_input(source: Storage, spill: Path) -> Path:
    """A local file with the input's bytes, to read lines again by offset: the input itself
    when it is local, else a copy in `spill` (an S3 object read once, as a stream)."""
    if isinstance(source, LocalStorage):
        return source.path
    copy = spill / "input.jsonl"
    try:
        with source.open_read() as f, open(copy, "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
    except StorageError as e:
        raise JobError(str(e)) from e
    except OSError as e:
        raise JobError(f"cannot copy the input to {spill}: {e}") from e
    return copy


class InputScan:
    """The first pass as a stream of prompts (each answered line's first input: what the
    prefix trie takes), filling the table, the token store and the errors file as it goes.
    Iterate `prompts()` once (group_by_prefix does); then read `result`."""

    def __init__(
        self,
        path: Path,
        opts: RunOptions,
        model,
        store: TokenStore,
        errors_path: Path,
        batch_id: str,
        progress: ScanProgress | None = None,
    ) -> None:
        self.path, self.opts, self.model, self.store = path, opts, model, store
        self.errors_path, self.batch_id, self.progress = errors_path, batch_id, progress
        self.result = ScannedInput(LineTable(), errors_path, 0, JobTraits(opts))

    def prompts(self) -> Iterator[list[int]]:
        table, traits = self.result.table, self.result.traits
        lines = 0
        with open(self.errors_path, "wb") as errors:
            scan = scan_lines(LocalStorage(str(self.path)), self.opts, self.model, {}, traits)
            offset = 0
            for item in scan:
                lines += 1
                if isinstance(item, LineError):  # in line order, as they come
                    record = error_line(item, batch_id=self.batch_id)
                    errors.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
                    self.result.num_errors += 1
                else:
                    entry = len(self.store)
                    for ids in item.inputs:
                        self.store.append(ids)
                    table.add(item, entry)
                    offset = item.offset + item.size
                    yield item.inputs[0]
                if self.progress is not None and lines % 256 == 0:
                    self.progress.update(lines, offset)
        if self.progress is not None:
            self.progress.lines = lines
            self.progress.done(offset)


def read_request(
    f: BinaryIO, table: LineTable, unit: int, opts: RunOptions, max_model_len: int
) -> JobRequest:
    """Answered line `unit` as the first pass judged it (read again at its offset, validated
    again; its prompt length from the table), its text dropped."""
    f.seek(table.offset[unit])
    raw = f.read(table.size[unit])
    item = next(
        iter(validate_lines([raw], model=opts.model_name, tool_call_parser=opts.tool_call_parser))
    )
    if isinstance(item, LineError):  # the file changed between the passes
        raise JobError(
            f"line {table.line[unit]} of {opts.input} changed while the job was submitted "
            f"({item.message.split(': ', 1)[-1]}): submit it again once it is complete"
        )
    item = dataclasses.replace(item, line=table.line[unit])
    if item.is_embedding:
        return dataclasses.replace(item, inputs=None)
    if item.is_score:  # the documents stay: a rerank answer shows them
        return dataclasses.replace(item, pairs=None)
    params = sampling_params_for(item, table.tokens[unit], max_model_len)
    return dataclasses.replace(item, messages=None, prompt=None, tools=None, params=params)

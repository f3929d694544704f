"""The lines of a job being submitted, in memory that does not grow with their text.

`kvbatch submit` reads its input once (`InputScan`): each line is validated and tokenized
(kvbatch.jobs.local.prepare.scan_lines: in chunks, by a pool of processes on a long job), its
token ids are spilled to a TokenStore (on disk), a bad line's error record to a spill file,
and what its shard request says besides the tokens (`unit_record`: custom_id, url, params,
...) to a third; the process keeps only a row of integers per answered line (`LineTable`):
its line number, where its record lies in that spill, its token-store entries and its prompt
tokens. The prefix trie (kvbatch.jobs.grouping) sees the prompts as they pass and keeps their
block hashes. Writing a shard reads its lines' records back by offset (`read_unit`): nothing
is validated twice, and an S3 input is read once, as a stream.

Per answered line that is 5 integers (40 bytes), the trie's hashes and the set of custom_ids;
the line's text, its JobRequest and its token list are gone once it is read.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from kvbatch.jobs.local.digest_index import DigestIndex
from kvbatch.jobs.local.options import RunOptions
from kvbatch.jobs.local.prepare import JobTraits, PreparedLine, scan_lines
from kvbatch.jobs.local.scan_progress import ScanProgress
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.openai_format.responses import error_line
from kvbatch.jobs.openai_format.validate import LineError
from kvbatch.jobs.request_record import unit_fields, unit_record
from kvbatch.jobs.storage import Storage


@dataclass
class LineTable:
    """A row of integers per answered line (a unit: an embeddings line's inputs are one), in
    input order: unit u is the u-th answered line."""

    line: array = field(default_factory=lambda: array("q"))  # 1-based input line
    offset: array = field(default_factory=lambda: array("q"))  # its unit_record's, in the spill
    size: array = field(default_factory=lambda: array("q"))  # bytes of that record
    entry: array = field(default_factory=lambda: array("q"))  # first token-store entry
    tokens: array = field(default_factory=lambda: array("q"))  # prompt tokens, all inputs

    def add(self, item: PreparedLine, entry: int, offset: int, size: int) -> None:
        self.line.append(item.line)
        self.offset.append(offset)
        self.size.append(size)
        self.entry.append(entry)
        self.tokens.append(sum(len(ids) for ids in item.inputs))

    def __len__(self) -> int:
        return len(self.line)


@dataclass
class ScannedInput:
    """What the first pass leaves: the table of answered lines, the error records' spill file
    and the job's traits."""

    table: LineTable
    errors_path: Path
    num_errors: int
    traits: JobTraits


class InputScan:
    """The first pass as a stream of prompts (each answered line's first input: what the
    prefix trie takes), filling the table, the token store, the records' spill and the errors
    file as it goes. Iterate `prompts()` once (group_by_prefix does); then read `result`."""

    def __init__(
        self,
        source: Storage,
        opts: RunOptions,
        model,
        store: TokenStore,
        spill: Path,
        batch_id: str,
        progress: ScanProgress | None = None,
    ) -> None:
        self.source, self.opts, self.model, self.store = source, opts, model, store
        self.batch_id, self.progress = batch_id, progress
        self.records_path = spill / "units.jsonl"
        self.result = ScannedInput(LineTable(), spill / "errors.jsonl", 0, JobTraits(opts))

    def prompts(self) -> Iterator[list[int]]:
        table, traits = self.result.table, self.result.traits
        lines = 0
        offset = 0  # in the input: how far the pass has read
        records_size = 0
        params_json: dict = {}  # equal params serialised once
        with open(self.result.errors_path, "wb") as errors, \
                open(self.records_path, "wb") as records:  # fmt: skip
            for item in scan_lines(self.source, self.opts, self.model, DigestIndex(), traits):
                lines += 1
                if isinstance(item, LineError):  # in line order, as they come
                    record = error_line(item, batch_id=self.batch_id)
                    errors.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
                    self.result.num_errors += 1
                else:
                    entry = len(self.store)
                    for ids in item.inputs:
                        self.store.append(ids)
                    raw = unit_record(item.request, params_json)
                    records.write(raw)
                    table.add(item, entry, records_size, len(raw))
                    records_size += len(raw)
                    offset = item.offset + item.size
                    yield item.inputs[0]
                if self.progress is not None and lines % 256 == 0:
                    self.progress.update(lines, offset)
        if self.progress is not None:
            self.progress.lines = lines
            self.progress.done(offset)


def read_unit(f: BinaryIO, table: LineTable, unit: int, prompts: list[list[int]]) -> dict:
    """Answered line `unit` as a ShardRequest's fields (a dict, in the field order), its
    record read back from the spill at its offset and `prompts` (its inputs' token ids) put
    in."""
    f.seek(table.offset[unit])
    return {"index": unit, **unit_fields(f.read(table.size[unit]), prompts)}

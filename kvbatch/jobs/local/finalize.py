"""The end of `kvbatch run`: the answers in the partial output, and the validation errors,
written as output.jsonl (input order), errors.jsonl (line order) and batch.json.

Streamed, for a job of any size: the partial output is read once, keeping three integers an
answer (its input line, and where its record lies in the partial), and a bit per input line
(taken); the answers are then sorted by line and copied by seeking. The errors of the
validation pass (spilled in line order) and of the engine (sorted by line) are merged as they
are written.

Which answers count. Each record in the partial names the digest of the input line it answers.
This run's answers are of lines as they are now, placed by the line number they carry. An
earlier run's (before `partial.resumed_at`) count only where the validation pass found those
very bytes again (`PreparedJob.answered`, by digest, with their line now): an answer to a line
since edited or removed, or to another job's input, is dropped.
"""

from __future__ import annotations

import heapq
import itertools
import json
import sys
from array import array
from collections.abc import Iterable, Iterator

import numpy as np

from kvbatch.jobs.local.digest_index import hex_key
from kvbatch.jobs.local.partial import PartialOutput
from kvbatch.jobs.local.paths import JobPaths
from kvbatch.jobs.local.prepare import PreparedJob
from kvbatch.jobs.openai_format.batch_record import MAX_BATCH_ERRORS, BatchRecord
from kvbatch.jobs.openai_format.responses import error_line
from kvbatch.jobs.storage import open_storage


class _Spans:
    """(input line, offset, length) of records in the partial output, 24 bytes each."""

    def __init__(self) -> None:
        self.lines, self.offsets, self.lengths = array("q"), array("q"), array("q")

    def add(self, line: int, offset: int, length: int) -> None:
        self.lines.append(line)
        self.offsets.append(offset)
        self.lengths.append(length)

    def __len__(self) -> int:
        return len(self.lines)

    def in_line_order(self) -> Iterator[tuple[int, int, int]]:
        order = np.argsort(np.frombuffer(self.lines, dtype=np.int64), kind="stable")
        for i in order.tolist():
            yield self.lines[i], self.offsets[i], self.lengths[i]


class _LineBits:
    """A set of input line numbers, a bit each."""

    def __init__(self) -> None:
        self.bits = bytearray()

    def take(self, line: int) -> bool:
        """Add `line`; False if it was there already."""
        byte, bit = divmod(line, 8)
        if byte >= len(self.bits):  # grown by half again, at least: amortised O(1)
            self.bits.extend(bytes(max(byte + 1, len(self.bits) * 3 // 2) - len(self.bits)))
        if self.bits[byte] >> bit & 1:
            return False
        self.bits[byte] |= 1 << bit
        return True


def finalize(paths: JobPaths, partial: PartialOutput, job: PreparedJob, record: BatchRecord):
    """Write answers in input order and errors by line number; count and sum usage."""
    answered, failed = _Spans(), _Spans()
    taken = _LineBits()
    for answer, digest, written_at, offset, length in partial.records():
        this_run = offset >= partial.resumed_at and written_at is not None
        n = written_at if this_run else job.answered.get(hex_key(digest))
        if n is None or not taken.take(n):  # another input's answer, or a line's second
            continue
        if answer.get("error"):
            failed.add(n, offset, length)
        else:
            answered.add(n, offset, length)
            body = answer["response"]["body"]
            record.add_usage(body["usage"])
            record.vectors += len(body.get("data") or ())  # an embeddings answer's
    write(paths.output, partial.read_at((o, ln) for _, o, ln in answered.in_line_order()))
    validation = ((e.line, _error_bytes(e, record.id)) for e in job.errors)
    numbers, spans = itertools.tee(failed.in_line_order())  # zip reads both in step
    from_engine = zip((n for n, _, _ in numbers), partial.read_at((o, ln) for _, o, ln in spans))
    samples: list[bytes] = []
    merged = heapq.merge(validation, from_engine, key=lambda e: e[0])
    write(paths.errors, _keep_first(MAX_BATCH_ERRORS, samples, (raw for _, raw in merged)))
    record.endpoint = job.endpoint
    record.finish(
        completed=len(answered),
        failed=len(job.errors) + len(failed),
        ran=len(answered) + len(failed),
        samples=(json.loads(raw)["error"] for raw in samples),
    )
    write(paths.batch, [json.dumps(record.to_dict(), indent=2).encode() + b"\n"])


def _error_bytes(error, batch_id: str) -> bytes:
    return json.dumps(error_line(error, batch_id=batch_id), ensure_ascii=False).encode() + b"\n"


def _keep_first(n: int, kept: list[bytes], items: Iterable[bytes]) -> Iterator[bytes]:
    """`items` as they are, the first `n` of them also put in `kept`."""
    for i, item in enumerate(items):
        if i < n:
            kept.append(item)
        yield item


def write(uri: str, chunks: Iterable[bytes]) -> None:
    """Write `chunks` to `uri` (a folder or S3 object, or -stderr)."""
    if uri == "-stderr":
        for c in chunks:
            sys.stderr.write(c.decode())
        return
    with open_storage(uri).open_write() as f:
        for c in chunks:
            f.write(c)

"""The input's lines, judged in chunks (kvbatch.jobs.local.line_chunks) by a pool of processes
once the job proves long, and handed back in input order.

Validating, rendering and encoding a line takes most of a millisecond of Python and Rust and
needs no other line, so a job of a million lines spreads it over the machine's cores: chunks
of CHUNK_LINES lines go to `workers` processes (forked, on Linux), at most two a process in
flight, and come back in order. The first POOL_AFTER_LINES lines are judged in this process (a
small job never pays for the processes), and so is every line while the model is not known
(`kvbatch run` reads it when a line first needs it), when the process holds the engine (a
`kvbatch run` with --max-model-len, which loads it first), and where fork is not the way to
start processes. A chunk whose process fails is judged here instead, with the rest of
the job: the records are the same either way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_all_start_methods, get_context
from typing import BinaryIO

from kvbatch.env_settings import env_number
from kvbatch.jobs.local.line_chunks import ChunkJudge, JudgedLine
from kvbatch.jobs.local.model_on_demand import GivenModel
from kvbatch.jobs.local.token_store import INT32
from kvbatch.jobs.openai_format.validate import read_lines

log = logging.getLogger("kvbatch.run")

CHUNK_LINES = 256
CHUNK_BYTES = 1 << 20  # a chunk of long lines ends sooner
POOL_AFTER_LINES = 2048
WORKERS_ENV = "KVBATCH_TOKENIZE_WORKERS"


def default_workers() -> int:
    """KVBATCH_TOKENIZE_WORKERS, else the cores this process may use (1: no pool). Raises
    SettingError (naming the variable) for a value that is not a whole number of at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return int(env_number(WORKERS_ENV, cores, minimum=1, unit="processes"))


@dataclass
class _Chunk:
    first: int  # line number of raws[0]
    raws: list[bytes]
    offsets: list[int]
    skip: frozenset[int]
    judged: list[JudgedLine | None] | None = None  # judged here
    future: Future | None = None  # or by the pool


class JudgedLines:
    """Iterate to get (JudgedLine, raw line, byte offset, byte size) for each non-blank line of
    `f`, in order. `skip(number, raw)` says which valid lines need no tokens (answered by an
    earlier run). `workers` > 1 allows a pool of that many processes."""

    def __init__(
        self,
        f: BinaryIO,
        judge: ChunkJudge,
        workers: int,
        skip: Callable[[int, bytes], bool] | None = None,
    ) -> None:
        self.f, self.judge, self.workers, self.skip = f, judge, workers, skip
        self.pool_after = POOL_AFTER_LINES
        self.pool: ProcessPoolExecutor | None = None
        self._pool_tried = workers <= 1

    def __iter__(self) -> Iterator[tuple[JudgedLine, bytes, int, int]]:
        pending: deque[_Chunk] = deque()
        try:
            for chunk in self._chunks():
                self._maybe_start_pool(chunk.first - 1)
                if self.pool is not None:
                    chunk.future = self.pool.submit(_judge_in_worker, chunk.first, chunk.raws,
                                                    chunk.skip)  # fmt: skip
                else:
                    chunk.judged = self.judge.judge(chunk.first, chunk.raws, chunk.skip)
                pending.append(chunk)
                while pending and (pending[0].future is None or len(pending) > 2 * self.workers):
                    yield from self._emit(pending.popleft())
            while pending:
                yield from self._emit(pending.popleft())
            self._stop_pool(wait=True)  # idle processes: reaped before the caller goes on
        finally:
            self._stop_pool()

    def _chunks(self) -> Iterator[_Chunk]:
        number, offset = 1, 0
        raws: list[bytes] = []
        offsets: list[int] = []
        size = 0
        for raw in read_lines(self.f):
            raws.append(raw)
            offsets.append(offset)
            offset += getattr(raw, "size", len(raw))  # an OversizedLine's whole length
            size += len(raw)
            if len(raws) >= CHUNK_LINES or size >= CHUNK_BYTES:
                yield self._chunk(number, raws, offsets)
                number += len(raws)
                raws, offsets, size = [], [], 0
        if raws:
            yield self._chunk(number, raws, offsets)

    def _chunk(self, first: int, raws: list[bytes], offsets: list[int]) -> _Chunk:
        skip = frozenset()
        if self.skip is not None:
            skip = frozenset(n for n, raw in enumerate(raws, start=first) if self.skip(n, raw))
        return _Chunk(first, raws, offsets, skip)

    def _emit(self, chunk: _Chunk) -> Iterator[tuple[JudgedLine, bytes, int, int]]:
        judged = chunk.judged
        if judged is None:
            try:
                judged = chunk.future.result()
            except Exception as e:  # a process died (out of memory) or could not be reached
                if self.pool is not None:  # said once; the chunks still pending were cancelled
                    log.warning("judging lines in a pool of processes failed (%s): the rest "
                                "of the job is judged in this process", e)  # fmt: skip
                    self._stop_pool()
                judged = self.judge.judge(chunk.first, chunk.raws, chunk.skip)
        for j, raw, offset in zip(judged, chunk.raws, chunk.offsets):
            if j is not None:
                yield j, raw, offset, getattr(raw, "size", len(raw))

    def _maybe_start_pool(self, lines_done: int) -> None:
        if self._pool_tried or lines_done < self.pool_after:
            return
        given = self.judge.model.given()
        if given is None:  # the model is not loaded yet: judged here until it is
            return
        self._pool_tried = True
        if "fork" not in get_all_start_methods() or sys.platform != "linux":
            return  # judged here, the tokenizer's own threads encoding each chunk
        # The pool's processes are forked: nothing is imported or sent again, and no script
        # that calls this runs twice (a spawned process would run an unguarded __main__).
        # Tokenizers turns its threads off in a process forked after it used them, and says
        # so on stderr unless TOKENIZERS_PARALLELISM is set: set to what it means here
        # (threads on); each process turns them off for itself.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
        judge = ChunkJudge(self.judge.rules, GivenModel(given.tokenizer, given.max_model_len))
        self.pool = ProcessPoolExecutor(
            self.workers,
            mp_context=get_context("fork"),
            initializer=_start_worker,
            initargs=(judge,),
        )

    def _stop_pool(self, wait: bool = False) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=wait, cancel_futures=True)
            self.pool = None


_JUDGE: ChunkJudge | None = None  # a pool process's own


def _start_worker(judge: ChunkJudge) -> None:
    global _JUDGE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a process: the pool is enough
    # Ctrl-C reaches the whole process group: the submitting process stops the pool, and a
    # process of it ends with its chunk instead of printing a traceback. A handler the parent
    # installed for SIGTERM (a Celery worker's warm shutdown) is not this process's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _JUDGE = judge


def _judge_in_worker(first: int, raws: list[bytes], skip: frozenset[int]):
    """The chunk's records, token ids as int32 arrays: they travel as bytes, where a list of
    Python ints would cost the receiving process more than the rest of the line."""
    judged = _JUDGE.judge(first, raws, skip)
    for i, j in enumerate(judged):
        if j is not None and isinstance(j.tokens, tuple):
            request, inputs = j.tokens
            tokens = (request, [array(INT32, ids) for ids in inputs])
            judged[i] = dataclasses.replace(j, tokens=tokens)
    return judged

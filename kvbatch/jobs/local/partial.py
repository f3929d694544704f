"""The answers of a running job, committed in flushed batches so a crash loses no whole line.

While a job runs, each finished request's output line is buffered and written here in batches
(write, flush, fsync): when `flush_lines` are waiting, and on a timer every `flush_seconds`
whatever has finished (a long request still running never holds back the short ones that
finished before it), and on every way out (`close`). A SIGKILL can tear at most the last line
of a batch; `recover()` cuts that torn tail, and `--resume` then skips every line already
answered here.

    {"kvbatch_partial": 1, "identity": {...}}     first line: what the answers belong to
    {"digest": <sha256 of the input line>, "line": <its line number>, "record": <output or
     error line>}                                                         one per answer

The identity (model, model name) and the per-line digests make `--resume` safe: answers of
another model are refused, and an answer whose input line changed (or is gone) is not reused.
A record's line number is that of the run that wrote it (lines may have moved since): an
earlier run's answers are placed by their digest (`resumed_at` says where this run's begin).

The file is created with O_EXCL | O_NOFOLLOW and reopened with O_NOFOLLOW: a link planted at
its name is never followed (its target is never truncated or written).
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvbatch.jobs.local.digest_index import DigestIndex, hex_key, id_number

FORMAT = 1


class PartialError(Exception):
    """The partial output cannot be used (another job's, unreadable, or not a plain file)."""


class PartialOutput:
    def __init__(self, path: Path, flush_lines: int = 64, flush_seconds: float = 2.0) -> None:
        self.path = path
        self.flush_lines, self.flush_seconds = flush_lines, flush_seconds
        self._buffer: list[bytes] = []
        self._lock = threading.Lock()
        self._file = None
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self.resumed_at = 0  # byte offset of this run's first answer (set by reset / recover)

    # -- opening -----------------------------------------------------------------------------

    def reset(self, identity: dict) -> DigestIndex:
        """Start empty (a fresh run): an old file (or a link planted at its name) is removed,
        never followed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise PartialError(
                f"cannot create the partial output {self.path}: {e.strerror}"
            ) from None
        self._file = os.fdopen(fd, "ab")
        header = _header(identity)
        self._write_now([header])
        self.resumed_at = len(header)
        return DigestIndex()

    def recover(self, identity: dict) -> DigestIndex:
        """{digest of an input line answered already (16 bytes: digest_index.hex_key): the
        id_number of the custom_id its answer names}; a torn last line (no newline) is cut
        off. (A digest met twice keeps its first answer's id, as finalizing keeps that answer.) Raises PartialError when the file belongs to another
        model or is not a partial output."""
        if not self.path.exists() and not self.path.is_symlink():
            return self.reset(identity)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(0, "not a regular file")
        except OSError as e:
            raise PartialError(
                f"cannot open the partial output {self.path}: {e.strerror} (a link or special "
                "file is never followed): remove it and run without --resume"
            ) from None
        f = os.fdopen(fd, "r+b")
        first = f.readline()
        if not first.endswith(b"\n"):  # killed before its header was whole: nothing committed
            f.close()
            return self.reset(identity)
        try:
            header = json.loads(first)
            found = header.get("identity") if isinstance(header, dict) else None
        except ValueError:
            found = None
        if found is None or header.get("kvbatch_partial") != FORMAT:
            f.close()
            raise PartialError(
                f"{self.path} is not a partial output this version of kvbatch wrote: remove it "
                "or run without --resume to start over"
            )
        if found != identity:
            f.close()
            raise PartialError(
                f"--resume: the answers in {self.path} were made by {_describe(found)}, not by "
                f"{_describe(identity)}: run with the same model, or without --resume to start "
                "over"
            )
        done = DigestIndex()
        keep = len(first)  # read a line at a time: a million answers never sit in memory
        try:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # the torn tail of a killed run
                item = json.loads(raw)
                done.add(hex_key(item["digest"]), id_number(item["record"]["custom_id"]))
                keep += len(raw)
        except (ValueError, KeyError, TypeError):
            f.close()
            raise PartialError(
                f"{self.path} holds a damaged line: remove it and run without --resume"
            ) from None
        f.truncate(keep)
        f.seek(keep)
        self._file = f
        self.resumed_at = keep
        return done

    # -- writing -----------------------------------------------------------------------------

    def add(self, record: dict, digest: str, line: int | None = None) -> None:
        """Buffer one answer (output or error line) of the input line whose digest (and line
        number) is given."""
        item = {"digest": digest, "record": record} if line is None else \
            {"digest": digest, "line": line, "record": record}  # fmt: skip
        line = json.dumps(item, ensure_ascii=False).encode()
        with self._lock:
            self._buffer.append(line + b"\n")
            full = len(self._buffer) >= self.flush_lines
        if full:
            self.flush()
        self._start_timer()

    def flush(self) -> None:
        """Commit what is buffered (write, flush, fsync)."""
        with self._lock:
            if self._buffer and self._file is not None:
                # Taken out first: a KeyboardInterrupt between the write and the clear would
                # otherwise write the batch twice (at close). Lost before the write, the lines
                # are only answered again by --resume.
                pending, self._buffer = self._buffer, []
                self._write_now(pending)

    def close(self) -> None:
        """Commit what is buffered and stop the timer; safe to call on any way out."""
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()
        self._timer = None
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write_now(self, lines: list[bytes]) -> None:
        self._file.write(b"".join(lines))
        self._file.flush()
        os.fsync(self._file.fileno())

    def _start_timer(self) -> None:
        if self._timer is None and not self._stop.is_set():
            self._timer = threading.Thread(target=self._flush_every, daemon=True)
            self._timer.start()

    def _flush_every(self) -> None:
        while not self._stop.wait(self.flush_seconds):
            try:
                self.flush()
            except OSError:
                return  # the next flush on the main path reports it

    # -- reading at the end ------------------------------------------------------------------

    def records(self) -> Iterator[tuple[dict, str, int | None, int, int]]:
        """Every committed answer (record, digest, line number as written or None) with its
        byte offset and length (see `read_at`)."""
        self.close()
        offset = 0
        with open(self.path, "rb") as f:
            for n, raw in enumerate(f):
                if n and raw.strip():
                    item = json.loads(raw)
                    yield item["record"], item["digest"], item.get("line"), offset, len(raw)
                offset += len(raw)

    def read_at(self, spans: Iterable[tuple[int, int]]) -> Iterator[bytes]:
        """The output lines at (offset, length) spans, in the order given: the answers are
        reordered by seeking, so finalizing a huge job holds offsets, not lines."""
        with open(self.path, "rb") as f:
            for offset, length in spans:
                f.seek(offset)
                record = json.loads(f.read(length))["record"]
                yield json.dumps(record, ensure_ascii=False).encode() + b"\n"

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def _header(identity: dict) -> bytes:
    return json.dumps({"kvbatch_partial": FORMAT, "identity": identity}).encode() + b"\n"


def _describe(identity: dict) -> str:
    return ", ".join(f"{k} {v!r}" for k, v in sorted(identity.items()))

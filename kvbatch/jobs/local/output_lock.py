"""One run per output: `kvbatch run` holds an exclusive lock on its output while it runs.

Two runs writing the same output would interleave their partial answers and finalize each
other's files. The second run refuses instead, naming the holder.

    local output   .<name>.lock beside it, locked with flock (released by the kernel when the
                   holder dies, so a killed run never leaves a stale lock); opened with
                   O_NOFOLLOW, so a planted link is never followed
    s3:// output   a lease object <output>.lock, created with IfNoneMatch (first writer wins),
                   renewed while the run lives and deleted at the end; a lease not renewed for
                   LEASE_SECONDS (its holder was killed) is taken over

`-` (stdout) has nothing to lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from kvbatch.jobs.storage import Storage, StorageError, open_storage

LEASE_SECONDS = 120.0
HOLDER_WRITE_GRACE = 2.0  # seconds a losing run waits to read the holder's record


class OutputBusy(Exception):
    """Another run holds the output."""


@dataclass(frozen=True)
class Holder:
    """Who holds an output: enough for a person to find the other run."""

    host: str
    pid: int
    input: str
    since: float
    expires_at: float = 0.0  # leases only

    @classmethod
    def me(cls, input_uri: str) -> Holder:
        return cls(socket.gethostname(), os.getpid(), input_uri, time.time())

    def is_live(self) -> bool:
        """False only for a record that names a process on this host that has exited."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # alive, owned by another user
        return True

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"kvbatch run pid {self.pid} on {self.host} (input {self.input}, since {since})"

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError):
            return None


@contextmanager
def output_lock(output_uri: str, input_uri: str) -> Iterator[None]:
    """Hold `output_uri` for the block; raise OutputBusy (naming the holder) if another run
    holds it."""
    if output_uri == "-":
        yield
        return
    me = Holder.me(input_uri)
    if output_uri.startswith("s3://"):
        with _lease(open_storage(output_uri + ".lock"), output_uri, me):
            yield
    else:
        with _flock(Path(output_uri), me):
            yield


@contextmanager
def _flock(output: Path, me: Holder) -> Iterator[None]:
    path = output.parent / f".{output.name}.lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OutputBusy(
                    f"{path} is a link: remove it (kvbatch never follows one)"
                ) from None
            raise StorageError(f"cannot lock {output}: {e.strerror} at {path}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = holder.describe() if holder else "another kvbatch run"
            raise OutputBusy(
                f"output {output} is in use by {who}: wait for it to finish, or choose another -o"
            ) from None
        # The holder before us may have removed the file after we opened it: lock the file
        # that is at the path now, or two runs would each hold a different inode.
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        # Written over the old record, then cut to length: a reader never sees a whole record
        # of a holder that is gone, only this one or bytes that do not parse (and waits).
        record = me.to_bytes()
        os.pwrite(fd, record, 0)
        os.ftruncate(fd, len(record))
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _read_holder(fd: int) -> Holder | None:
    """The holder's record, waiting briefly for it: a run writes it just after taking the lock,
    so a run that loses the race by microseconds can find the file empty, or still holding the
    record of a killed run (a process on this host that no longer exists)."""
    deadline = time.monotonic() + HOLDER_WRITE_GRACE
    while True:
        holder = Holder.parse(os.pread(fd, 4096, 0))
        if holder is not None and holder.is_live():
            return holder
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)


@contextmanager
def _lease(lease: Storage, output_uri: str, me: Holder) -> Iterator[None]:
    def claim() -> bool:
        mine = Holder(**{**asdict(me), "expires_at": time.time() + LEASE_SECONDS})
        return lease.write_if_absent(mine.to_bytes())

    if not claim():
        with lease.open_read() as f:
            holder = Holder.parse(f.read())
        if holder is not None and holder.expires_at > time.time():
            raise OutputBusy(
                f"output {output_uri} is in use by {holder.describe()} (its lease "
                f"{lease.uri} is live): wait for it to finish, or choose another -o"
            )
        lease.delete()  # its holder stopped renewing it: it was killed
        if not claim():
            raise OutputBusy(f"output {output_uri} was just taken by another run ({lease.uri})")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(LEASE_SECONDS / 4):
            mine = Holder(**{**asdict(me), "expires_at": time.time() + LEASE_SECONDS})
            try:
                lease.write_bytes(mine.to_bytes())
            except StorageError:
                continue  # tried again next round; the lease lasts four rounds

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        try:
            lease.delete()
        except StorageError:
            pass  # it expires by itself

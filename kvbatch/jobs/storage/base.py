"""The Storage contract shared by local paths, stdin/stdout and S3, and key validation."""

from __future__ import annotations

import os
import re
import stat
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import BinaryIO


class StorageError(Exception):
    """A storage operation failed. The message says what failed, on which URI, and what to do."""


class AlreadyExists(StorageError):
    """A conditional write (`if_absent=True`) found the object already written by someone else."""


def refuse_endless_input(uri: str, st: os.stat_result) -> None:
    """Raise StorageError unless a file of this kind (`st`, its stat) can be read to its end:
    a regular file, a pipe, a socket or /dev/null. Another device (/dev/zero, /dev/urandom, a
    disk) may never end, and a job's input is read whole before the model runs a line."""
    if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) or _is_dev_null(st):
        return
    kind = "a character device" if stat.S_ISCHR(st.st_mode) else "a block device"
    raise StorageError(
        f"{uri} is {kind}, not a file: a job is read to its end, and a device may never end; "
        "give a file, or pipe the job in"
    )


def _is_dev_null(st: os.stat_result) -> bool:
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == null.st_rdev


# One path segment or key segment: safe as a file name on every platform and as an S3 key part
# that needs no URL escaping. Job ids go through the same check.
_SEGMENT = re.compile(r"[A-Za-z0-9._=-]+")
_MAX_SEGMENT = 255  # the common file-name limit (ext4, APFS, NTFS)


def validate_key_part(part: str) -> str:
    """Return `part` unchanged if it is a safe single path/key segment, else raise ValueError
    naming it. Safe: 1 to 255 characters from [A-Za-z0-9._=-], and not '.' or '..'."""
    if not isinstance(part, str):
        raise ValueError(f"key part {part!r} must be a string")
    if part in ("", ".", ".."):
        raise ValueError(f"key part {part!r} is not allowed: it must name something")
    if len(part) > _MAX_SEGMENT:
        raise ValueError(f"key part {part[:40]!r}... is longer than {_MAX_SEGMENT} characters")
    if not _SEGMENT.fullmatch(part):
        bad = sorted({c for c in part if not _SEGMENT.fullmatch(c)})
        raise ValueError(
            f"key part {part!r} has characters {''.join(bad)!r} that are not allowed: "
            "use only letters, digits and . _ = -"
        )
    return part


def relative_key(*parts: str) -> str:
    """Join `parts` into one relative key 'a/b/c', validating every '/'-separated segment
    (so no '..', no absolute parts, no empty segments)."""
    if not parts:
        raise ValueError("join needs at least one part")
    segments: list[str] = []
    for part in parts:
        if not isinstance(part, str):
            raise ValueError(f"key part {part!r} must be a string")
        if part.startswith("/"):
            raise ValueError(f"key part {part!r} is absolute: give a relative part")
        for segment in part.split("/"):
            try:
                validate_key_part(segment)
            except ValueError as e:
                if segment == part:
                    raise
                raise ValueError(f"in {part!r}: {e}") from None
            segments.append(segment)
    return "/".join(segments)


def validate_list_prefix(prefix: str) -> str:
    """A list() prefix is a partial relative key: same characters as keys plus '/', no '..'."""
    if prefix and (
        prefix.startswith("/")
        or not re.fullmatch(r"[A-Za-z0-9._=/-]+", prefix)
        or ".." in prefix.split("/")
    ):
        raise ValueError(f"list prefix {prefix!r} is not a relative key prefix")
    return prefix


class Storage(ABC):
    """One object (file) or folder (prefix) named by a URI.

    Read side: `check_readable` fails fast before any work; `open_read` streams. Write side:
    `check_writable` fails fast before inference; `write_bytes` / `open_write` replace the
    object whole (readers never see a partial object); `write_if_absent` / `open_write(
    if_absent=True)` write at most once across processes (first writer wins). Every failure
    is a StorageError whose message names the URI.
    """

    uri: str

    @abstractmethod
    def open_read(self) -> BinaryIO:
        """A binary stream over the object; `for line in f` yields bytes lines. Raises
        StorageError if it is missing or unreadable."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether the object exists (errors other than 'not found' raise StorageError)."""

    @abstractmethod
    def check_readable(self) -> None:
        """Raise StorageError unless `open_read` would succeed; reads no content."""

    @abstractmethod
    def check_writable(self) -> None:
        """Raise StorageError unless an object can be written at this URI (probes the parent
        folder or prefix; leaves nothing behind)."""

    def write_bytes(self, data: bytes) -> None:
        """Write the whole object, replacing any previous one atomically."""
        with self.open_write() as f:
            f.write(data)

    def write_if_absent(self, data: bytes) -> bool:
        """Write the whole object unless it exists: True if written, False if it already
        existed. Atomic: a reader sees nothing or all of `data`."""
        try:
            with self.open_write(if_absent=True) as f:
                f.write(data)
        except AlreadyExists:
            return False
        return True

    @abstractmethod
    def open_write(self, if_absent: bool = False) -> AbstractContextManager[BinaryIO]:
        """A streaming writer; the object appears only when the block exits without an
        exception (an exception discards everything written). With `if_absent`, the exit
        raises AlreadyExists if another writer got there first."""

    def delete(self) -> None:
        """Remove the object if it exists (used for leases; job files are never deleted)."""
        raise StorageError(f"cannot delete {self.uri}: this storage does not delete")

    def delete_tree(self) -> None:
        """Remove every object under this folder/prefix (a finished stage job of an index run,
        whose rows are merged); nothing else is ever deleted in bulk."""
        for key in list(self.list()):
            self.join(key).delete()

    @abstractmethod
    def open_append(self) -> AbstractContextManager[BinaryIO]:
        """An appending writer (local files only: resume appends batches as they finish)."""

    @abstractmethod
    def join(self, *parts: str) -> Storage:
        """The child `parts` under this folder/prefix; each part is validated (relative_key)."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Relative names of the objects under this folder/prefix that start with `prefix`,
        recursively, sorted."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

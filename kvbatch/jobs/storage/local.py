"""Local files. Whole-object writes go to a temp file in the same folder and are renamed into
place (os.replace), so a reader sees the old file or the new one, never half of one; exclusive
writes hard-link the finished temp file (os.link fails if the name exists), which gives
first-writer-wins without ever exposing a partial file."""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from kvbatch.jobs.storage.base import (
    AlreadyExists,
    Storage,
    StorageError,
    refuse_endless_input,
    relative_key,
    validate_list_prefix,
)

# Temp names end with '~', a character no valid key has: they cannot clash with a real name,
# and list() skips them.
_TMP_SUFFIX = ".tmp~"


class LocalStorage(Storage):
    """A file or folder on the local file system."""

    def __init__(self, uri: str):
        self.uri = uri
        self.path = Path(uri).expanduser()

    def open_read(self) -> BinaryIO:
        try:
            return open(self.path, "rb")
        except FileNotFoundError:
            raise StorageError(f"{self.uri} not found: check the path") from None
        except IsADirectoryError:
            raise StorageError(f"{self.uri} is a directory: name a file to read") from None
        except OSError as e:
            raise StorageError(f"cannot read {self.uri}: {e.strerror}") from None

    def exists(self) -> bool:
        return self.path.exists()

    def check_readable(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            st = None  # open_read names the problem
        if st is not None:
            refuse_endless_input(self.uri, st)
        self.open_read().close()

    def check_writable(self) -> None:
        if self.path.is_dir():
            raise StorageError(f"cannot write {self.uri}: it is a directory; name a file in it")
        if self.path.exists() and not self.path.is_file():
            raise StorageError(
                f"cannot write {self.uri}: it exists and is not a regular file (a device, pipe "
                "or socket would be replaced); name a file, or '-' for stdout"
            )
        fd, tmp = self._create_temp()
        os.close(fd)
        os.unlink(tmp)

    @contextmanager
    def open_write(self, if_absent: bool = False) -> Iterator[BinaryIO]:
        fd, tmp = self._create_temp()
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            self._publish(tmp, if_absent)
        finally:
            with suppress(FileNotFoundError):
                os.unlink(tmp)  # still there after an exception or after os.link

    def delete(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:
            raise StorageError(f"cannot delete {self.uri}: {e.strerror}") from None

    def delete_tree(self) -> None:
        """The folder and its sub-folders too (a link is removed, never followed)."""
        if self.path.is_symlink() or self.path.is_file():
            self.path.unlink()
        elif self.path.is_dir():
            shutil.rmtree(self.path)

    def open_append(self) -> BinaryIO:
        self._make_parent()
        try:
            return open(self.path, "ab")
        except OSError as e:
            raise StorageError(f"cannot append to {self.uri}: {e.strerror}") from None

    def join(self, *parts: str) -> LocalStorage:
        return LocalStorage(str(self.path / relative_key(*parts)))

    def list(self, prefix: str = "") -> Iterator[str]:
        validate_list_prefix(prefix)
        names = []
        for root, _dirs, files in os.walk(self.path):
            rel = Path(root).relative_to(self.path)
            for name in files:
                key = (rel / name).as_posix()
                if not name.endswith(_TMP_SUFFIX) and key.startswith(prefix):
                    names.append(key)
        yield from sorted(names)

    def _publish(self, tmp: str, if_absent: bool) -> None:
        try:
            if not if_absent:
                os.replace(tmp, self.path)
                return
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                raise AlreadyExists(f"{self.uri} already exists: another writer made it") from None
        except OSError as e:
            raise StorageError(f"cannot write {self.uri}: {e.strerror}") from None

    def _create_temp(self) -> tuple[int, str]:
        """An exclusive new temp file next to the target (same file system, so the rename is
        atomic), with the permissions the umask gives ordinary files (mkstemp would give 0600)."""
        parent = self._make_parent()
        tmp = str(parent / f".{self.path.name}.{secrets.token_hex(6)}{_TMP_SUFFIX}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except OSError as e:
            raise StorageError(f"cannot write {self.uri}: {e.strerror} in {parent}") from None

    def _make_parent(self) -> Path:
        parent = self.path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            blocker = next((p for p in [parent, *parent.parents] if p.exists()), parent)
            if not blocker.is_dir():
                raise StorageError(
                    f"cannot write {self.uri}: {blocker} is a file, not a folder: "
                    "move it or choose another output"
                ) from None
            raise StorageError(
                f"cannot write {self.uri}: cannot create folder {parent}: {e.strerror}"
            ) from None
        return parent

"""A set of 16-byte digests, each with an integer, in 24 bytes an entry however many there are.

A job of a million lines asks per line "was this custom_id seen?" and "did an earlier run answer
these bytes?". A Python set or dict of strings answers in some 150 bytes an entry; this keeps
the digests in one sorted numpy array of 16-byte strings (and their integers in another) and
answers by binary search. Entries arrive one at a time, so the newest wait in a dict that is
merged into the arrays (a linear merge, not a sort) once it holds `merge_every` entries or an
eighth of the arrays' (so merges stay few as the index grows, and the dict small beside it).

A digest is 128 bits of a cryptographic hash (`key_of`, or a line digest's hex), so two
different keys share one with a chance of about n^2 / 2^129: nil for any job.
"""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_BYTES = 16
_KEYS = f"S{DIGEST_BYTES}"  # fixed-width bytes: compared byte by byte, sorted lexically


def key_of(text: str) -> bytes:
    """The 16-byte digest of `text` (a custom_id): what the index holds instead of the text."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES).digest()


def id_number(text: str) -> int:
    """A 64-bit number of `text` (a custom_id), for telling which id a digest was stored with."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def hex_key(hex_digest: str) -> bytes:
    """A line digest (kvbatch.jobs.local.line_chunks.line_digest: 32 hex digits) as 16 bytes."""
    return bytes.fromhex(hex_digest)


class DigestIndex:
    """{16-byte digest: int}, with set-like `in`, `add` and `get`. The first value added for a
    digest stays (a later `add` of the same digest is ignored)."""

    def __init__(self, merge_every: int = 4096) -> None:
        self.merge_every = merge_every
        self._keys = np.empty(0, dtype=_KEYS)
        self._values = np.empty(0, dtype=np.int64)
        self._recent: dict[bytes, int] = {}

    def add(self, digest: bytes, value: int = 0) -> None:
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"a digest is {DIGEST_BYTES} bytes, got {len(digest)}")
        if digest in self._recent or self._find(digest) is not None:
            return
        self._recent[digest] = value
        if len(self._recent) >= max(self.merge_every, len(self._keys) // 8):
            self._merge()

    def get(self, digest: bytes, default: int | None = None) -> int | None:
        value = self._recent.get(digest)
        if value is not None:
            return value
        at = self._find(digest)
        return default if at is None else int(self._values[at])

    def __contains__(self, digest: object) -> bool:
        if not isinstance(digest, bytes):
            return False
        return digest in self._recent or self._find(digest) is not None

    def __len__(self) -> int:
        return len(self._keys) + len(self._recent)

    def __bool__(self) -> bool:
        return len(self) > 0

    @property
    def nbytes(self) -> int:
        """Bytes the merged arrays hold (the recent dict aside)."""
        return self._keys.nbytes + self._values.nbytes

    def _find(self, digest: bytes) -> int | None:
        if not len(self._keys):
            return None
        # Both ends by binary search: a numpy bytes item drops its trailing zero bytes, so it
        # is never compared with the digest as Python bytes.
        query = np.array(digest, dtype=_KEYS)
        at = int(np.searchsorted(self._keys, query))
        found = np.searchsorted(self._keys, query, side="right") > at
        return at if found else None

    def _merge(self) -> None:
        keys = np.fromiter(self._recent, dtype=_KEYS, count=len(self._recent))
        values = np.fromiter(self._recent.values(), dtype=np.int64, count=len(self._recent))
        order = np.argsort(keys, kind="stable")
        keys, values = keys[order], values[order]
        at = np.searchsorted(self._keys, keys)
        self._keys = np.insert(self._keys, at, keys)
        self._values = np.insert(self._values, at, values)
        self._recent = {}

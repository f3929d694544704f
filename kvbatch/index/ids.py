"""Content hashes and ids. A chunk's id is a hash of its document's id and its text, never its
position: an edit elsewhere in the document leaves the chunk's id, and so its row, as it was."""

from __future__ import annotations

import hashlib


def content_hash(data: bytes | str) -> str:
    """sha256 of the bytes (text as UTF-8), hex."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()


def chunk_id(document_id: str, text: str, occurrence: int) -> str:
    """The id of the `occurrence`-th (from 0) chunk of `document_id` whose text is `text`: two
    identical chunks of one document (a repeated disclaimer) get distinct ids, in order."""
    key = f"{document_id}\0{text}" + (f"\0{occurrence}" if occurrence else "")
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]

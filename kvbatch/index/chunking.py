"""Token-aware chunking with the embedding model's own tokenizer.

A document is cut where its structure says first: at Markdown headings (trafilatura writes an
HTML page's headings as Markdown too). Consecutive sections are packed into one chunk while
they fit in `size` tokens; a section that alone is too long is cut by semchunk, which splits
at the largest run of newlines first (paragraphs), then at sentence ends, then at words, with
`overlap` tokens shared by its consecutive pieces. So: headings > paragraphs > sentences.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import semchunk

from kvbatch.index.ids import chunk_id, content_hash

_HEADING = re.compile(r"^#{1,6}[ \t]", re.MULTILINE)


@dataclass(frozen=True)
class Chunk:
    chunk_id: str
    chunk_hash: str
    index: int  # position in the document: for ordering, never identity
    text: str


class Chunker:
    """Cuts texts into chunks of at most `size` tokens (as `count_tokens` counts them)."""

    def __init__(self, count_tokens: Callable[[str], int], size: int, overlap: int) -> None:
        self.count_tokens = count_tokens
        self.size = size
        self.overlap = overlap
        self._split = semchunk.chunkerify(count_tokens, chunk_size=size)

    @classmethod
    def for_tokenizer(cls, tokenizer, size: int, overlap: int) -> Chunker:
        """Counts as the embedding model will: its tokenizer, without the special tokens (the
        embedding stage checks the whole input against the model's limit). Not verbose: a whole
        document is counted too, and transformers would warn it is longer than the model takes."""

        def count(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False, verbose=False))

        return cls(count, size, overlap)

    def chunk(self, document_id: str, text: str, source: str = "") -> list[Chunk]:
        """The document's chunks; their ids are of `source` too (the name of the spec's source:
        two sources holding a document of the same name and text never share a row)."""
        texts = self.split(text)
        key = f"{source}\0{document_id}" if source else document_id
        seen: Counter[str] = Counter()
        chunks = []
        for i, t in enumerate(texts):
            chunks.append(Chunk(chunk_id(key, t, seen[t]), content_hash(t), i, t))
            seen[t] += 1
        return chunks

    def split(self, text: str) -> list[str]:
        """The chunk texts, in document order."""
        out: list[str] = []
        packed = ""
        for section in _sections(text):
            joined = f"{packed}\n\n{section}" if packed else section
            if self.count_tokens(joined) <= self.size:
                packed = joined
                continue
            if packed:
                out.append(packed)
            if self.count_tokens(section) <= self.size:
                packed = section
            else:
                out.extend(self._pieces(section))
                packed = ""
        if packed:
            out.append(packed)
        return [t for t in out if t.strip()]

    def _pieces(self, section: str) -> list[str]:
        overlap = self.overlap or None
        return [p.strip() for p in self._split(section, overlap=overlap) if p.strip()]


def _sections(text: str) -> list[str]:
    """The text cut before each Markdown heading line (the heading starts its section)."""
    starts = [m.start() for m in _HEADING.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    bounds = [*starts, len(text)]
    return [s for a, b in zip(bounds, bounds[1:]) if (s := text[a:b].strip())]

"""A large chat job as users send them: documents x questions, about 1.7 KB a line.

Line i asks question i // D of document i % D (D documents), so lines of one document are
spread over the whole file and only the prefix order brings them together. Lines are made
one at a time from the seed: a million-line file is written without being held.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_WORDS = (
    "the batch engine reads every prompt once and keeps only what it needs a shard holds "
    "requests that share a document so the prefix is computed once per worker questions "
    "about revenue growth margins customers risks markets products teams plans quarters "
    "regions suppliers contracts audits forecasts budgets hiring churn pricing"
).split()

QUESTIONS_PER_DOCUMENT = 20


def document(d: int, words: int = 240) -> str:
    """Document `d`: about 1.5 KB of text, the same for every line that cites it."""
    rng = random.Random(d)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def write_chat_job(
    path: Path,
    num_lines: int,
    *,
    bad_lines: dict[int, bytes] | None = None,
    words: int = 240,
    max_tokens: int = 16,
    temperature: float | None = None,
) -> Path:
    """Write the job to `path`; `bad_lines` ({1-based line: raw bytes}) replace lines (a
    malformed line at line 900,000, say); `words` per document (240: about 1.7 KB a line);
    every line's `max_tokens` and `temperature` (None: not set, the API's 1). Returns the
    path."""
    bad_lines = bad_lines or {}
    num_documents = max(1, num_lines // QUESTIONS_PER_DOCUMENT)
    documents: dict[int, str] = {}
    with open(path, "wb", buffering=1 << 20) as f:
        for i in range(num_lines):
            if i + 1 in bad_lines:
                f.write(bad_lines[i + 1].rstrip(b"\n") + b"\n")
                continue
            d = i % num_documents
            if d not in documents:
                documents[d] = document(d, words)
            f.write(_encode(i, d, i // num_documents, documents[d], max_tokens, temperature))
    return path


def _encode(i: int, d: int, q: int, text: str, max_tokens: int, temperature: float | None) -> bytes:
    line = {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [
                {"role": "system", "content": "Answer from the document.\n" + text},
                {"role": "user", "content": f"Question {q} about document {d}: what is said?"},
            ],
            "max_tokens": max_tokens,
        },
    }
    if temperature is not None:
        line["body"]["temperature"] = temperature
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"

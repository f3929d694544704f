"""The requests of a job being run, spilled to disk with a few integers a line kept in memory.

`kvbatch run` needs each line's JobRequest twice: when it feeds the engine (in prefix order,
not input order) and when it writes the answer. Kept in a list they cost some 500 bytes a line
(half a gigabyte at a million lines); here each request is pickled once into a spill file in
the job's private folder (kvbatch.jobs.local.spill: written and read back by this process
only) and loaded when asked (the last few cached): some 360 bytes a chat line on disk.

A job's lines mostly share a few kinds of sampling params (half a request's pickle): each
kind is pickled once, up to DISTINCT_PARAMS kinds, and a request names its kind instead (a
request of another kind carries its own). Loading unpickles the params afresh, so no two
requests share a SamplingParams object.

Indexed like the token store, by entry: an embeddings or score line with k inputs fills k
entries that share its one request. Kept per entry: which request (8 bytes), which of its
inputs (4), its output cap and choices (16, for the ETA); per request the 16-byte digest of its
input line (what an answer is an answer to: kvbatch.jobs.local.partial) and its params' kind
(8).
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from array import array
from pathlib import Path

from kvbatch.jobs.local.digest_index import DIGEST_BYTES, hex_key
from kvbatch.jobs.local.eta import JobWork
from kvbatch.jobs.local.spill import SpillFile
from kvbatch.jobs.openai_format.validate import JobRequest

# Requests kept loaded. A request is asked for when it is fed to the engine and twice more,
# back to back, when it finishes: a small cache serves the repeats; the feed's one load each
# is what a line costs (some 15 microseconds).
CACHED_REQUESTS = 256
DISTINCT_PARAMS = 1024  # kinds of sampling params pickled once (the rest: with their request)


class RequestStore:
    def __init__(self, folder: str | Path | None = None) -> None:
        self._spill = SpillFile(folder, prefix="kvbatch-requests-")
        self._request_of = array("q")  # per entry: its request's index in the spill
        self._input_of = array("l")  # per entry: which input of its line
        self.max_tokens = array("q")  # per entry: output cap (0: generates nothing)
        self.choices = array("q")  # per entry: choices (n; 0: generates nothing)
        self._digests = bytearray()  # per request: DIGEST_BYTES
        self._kind_of = array("l")  # per request: its params' kind, or -1 (pickled with it)
        self._kinds: dict[bytes, int] = {}  # a kind of params, pickled: its index
        self._kind_pickles: list[bytes] = []
        self._load = functools.lru_cache(maxsize=CACHED_REQUESTS)(self._unpickle)

    def add_line(self, request: JobRequest, digest: str, num_inputs: int) -> int:
        """Store a line's request once, for its `num_inputs` entries; returns its first entry."""
        first = len(self._request_of)
        cap, n = JobWork.row(request)
        kind = self._kind(request.params)
        if kind >= 0:
            request = dataclasses.replace(request, params=None)
        index = self._spill.append(pickle.dumps(request, pickle.HIGHEST_PROTOCOL))
        self._kind_of.append(kind)
        self._digests += hex_key(digest)
        for i in range(num_inputs):
            self._request_of.append(index)
            self._input_of.append(i)
            self.max_tokens.append(cap)
            self.choices.append(n)
        return first

    def __len__(self) -> int:
        return len(self._request_of)

    def __getitem__(self, entry: int) -> JobRequest:
        return self._load(self._request_of[entry])

    def input_index(self, entry: int) -> int:
        """Which input of its line entry `entry` is (0 but for embeddings and scores)."""
        return self._input_of[entry]

    def digest(self, entry: int) -> str:
        """The digest (kvbatch.jobs.local.line_chunks.line_digest) of the entry's input line."""
        at = self._request_of[entry] * DIGEST_BYTES
        return self._digests[at : at + DIGEST_BYTES].hex()

    def work(self, prompt_tokens: int, cached_tokens: int) -> JobWork:
        """What the job asks of the engine (kvbatch.jobs.local.eta), without loading a request."""
        return JobWork(prompt_tokens, cached_tokens, self.max_tokens, self.choices)

    def close(self) -> None:
        self._load.cache_clear()
        self._spill.close()

    def _kind(self, params) -> int:
        if params is None:
            return -1
        key = pickle.dumps(params, pickle.HIGHEST_PROTOCOL)
        kind = self._kinds.get(key)
        if kind is None and len(self._kind_pickles) < DISTINCT_PARAMS:
            kind = self._kinds[key] = len(self._kind_pickles)
            self._kind_pickles.append(key)
        return -1 if kind is None else kind

    def _unpickle(self, index: int) -> JobRequest:
        request = pickle.loads(self._spill[index])  # our own file, in our own 0700 folder
        kind = self._kind_of[index]
        if kind >= 0:
            request = dataclasses.replace(request, params=pickle.loads(self._kind_pickles[kind]))
        return request

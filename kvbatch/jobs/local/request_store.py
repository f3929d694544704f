"""The requests of a job being run, spilled to disk with a few integers a line kept in memory.

`kvbatch run` needs each line's JobRequest twice: when it feeds the engine (in prefix order,
not input order) and when it writes the answer. Kept in a list they cost some 500 bytes a line
(half a gigabyte at a million lines); here each request is written once, as the JSON record a
shard request holds of its line (kvbatch.jobs.request_record), into a spill file in the job's
private folder (kvbatch.jobs.local.spill), and read back when asked (the last few cached).

Indexed like the token store, by entry: an embeddings or score line with k inputs fills k
entries that share its one request. Kept per entry: which request (8 bytes), which of its
inputs (4), its output cap and choices (16, for the ETA); per request the 16-byte digest of its
input line (what an answer is an answer to: kvbatch.jobs.local.partial) and its number of
inputs (4).
"""

from __future__ import annotations

import functools
from array import array
from pathlib import Path

from kvbatch.jobs.local.digest_index import DIGEST_BYTES, hex_key
from kvbatch.jobs.local.eta import JobWork
from kvbatch.jobs.local.spill import SpillFile
from kvbatch.jobs.openai_format.validate import JobRequest
from kvbatch.jobs.request_record import job_request_of, unit_fields, unit_record

# Requests kept loaded. A request is asked for when it is fed to the engine and twice more,
# back to back, when it finishes: a small cache serves the repeats; the feed's one load each
# is what a line costs (some 15 microseconds).
CACHED_REQUESTS = 256


class RequestStore:
    def __init__(self, folder: str | Path | None = None) -> None:
        self._spill = SpillFile(folder, prefix="kvbatch-requests-")
        self._request_of = array("q")  # per entry: its request's index in the spill
        self._input_of = array("l")  # per entry: which input of its line
        self.max_tokens = array("q")  # per entry: output cap (0: generates nothing)
        self.choices = array("q")  # per entry: choices (n; 0: generates nothing)
        self._digests = bytearray()  # per request: DIGEST_BYTES
        self._inputs = array("l")  # per request: its line's inputs (entries)
        self._params_json: dict = {}  # equal params turned to JSON once (request_record)
        self._cached = functools.lru_cache(maxsize=CACHED_REQUESTS)(self._load)

    def add_line(self, request: JobRequest, digest: str, num_inputs: int) -> int:
        """Store a line's request once, for its `num_inputs` entries; returns its first entry."""
        first = len(self._request_of)
        cap, n = JobWork.row(request)
        index = self._spill.append(unit_record(request, self._params_json))
        self._inputs.append(num_inputs)
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
        return self._cached(self._request_of[entry])

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
        self._cached.cache_clear()
        self._spill.close()

    def _load(self, index: int) -> JobRequest:
        no_prompts: list[list[int]] = [[]] * self._inputs[index]  # the token store has them
        return job_request_of(unit_fields(self._spill[index], no_prompts))

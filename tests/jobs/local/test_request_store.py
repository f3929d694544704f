"""The spills of `kvbatch run`: requests, errors and token ids come back as they went in,
read by index in any order."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvbatch.engine import SamplingParams
from kvbatch.jobs import request_record
from kvbatch.jobs.local.eta import JobWork
from kvbatch.jobs.local.line_chunks import line_digest
from kvbatch.jobs.local.line_errors import LineErrors
from kvbatch.jobs.local.request_store import RequestStore
from kvbatch.jobs.local.spill import SpillFile
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.openai_format.tools import ToolCalling
from kvbatch.jobs.openai_format.validate import JobRequest, LineError


def _request(line: int, *, url="/v1/chat/completions", **kw) -> JobRequest:
    params = SamplingParams(max_tokens=5 + line, n=1 + line % 2, temperature=0.5)
    return JobRequest(line=line, custom_id=f"c-{line}", url=url, messages=None, prompt=None,
                      params=params, logprobs=None, model="m", **kw)  # fmt: skip


def test_requests_come_back_by_entry_with_their_digest_and_input(tmp_path: Path):
    chat, embed, other = (
        _request(1),
        _request(2, url="/v1/embeddings", num_inputs=3, dimensions=8),
        _request(4),
    )
    store = RequestStore(tmp_path)
    assert store.add_line(chat, line_digest(b"one"), 1) == 0
    assert store.add_line(embed, line_digest(b"two"), 3) == 1
    assert store.add_line(other, line_digest(b"four"), 1) == 4
    assert len(store) == 5
    for entry in (4, 2, 0, 3, 1):  # any order
        request = [chat, embed, embed, embed, other][entry]
        assert store[entry] == request
    assert [store.input_index(i) for i in range(5)] == [0, 0, 1, 2, 0]
    assert [store.digest(i) for i in range(5)] == [line_digest(b) for b in
                                                   (b"one", b"two", b"two", b"two", b"four")]  # fmt: skip
    work = store.work(100, 40)
    expected = JobWork.of([chat, embed, embed, embed, other], 100, 40)
    assert list(work.max_tokens) == list(expected.max_tokens) == [6, 0, 0, 0, 9]
    assert list(work.choices) == list(expected.choices) == [2, 0, 0, 0, 1]
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].stat().st_mode & 0o077 == 0  # private
    store.close()
    assert not list(tmp_path.iterdir())


def test_line_errors_keep_their_order_and_gain_advice(tmp_path: Path):
    errors = LineErrors(tmp_path)
    made = [
        LineError(3, "a", "invalid_json", "line 3: not JSON"),
        LineError(7, None, "context_length_exceeded", "line 7: 900 tokens"),
        LineError(9, "é", "context_length_exceeded", "line 9: 901 tokens"),
    ]
    for e in made:
        errors.append(e)
    assert list(errors) == made and len(errors) == 3
    errors.advise("context_length_exceeded", "; pass --max-model-len 1024")
    got = list(errors)
    assert got[0] == made[0]
    assert [e.message for e in got[1:]] == [e.message + "; pass --max-model-len 1024"
                                            for e in made[1:]]  # fmt: skip
    errors.close()


def test_a_spill_is_sealed_by_its_first_read_and_tokens_round_trip(tmp_path: Path):
    spill = SpillFile(tmp_path)
    spill.append(b"abc")
    spill.append(b"")
    assert (spill[1], spill[0]) == (b"", b"abc")
    with pytest.raises(RuntimeError, match="sealed"):
        spill.append(b"late")
    spill.close()
    with TokenStore(tmp_path) as tokens:
        tokens.append([1, 2, 2**31 - 1])
        tokens.append([])
        assert (tokens[0], tokens[1], len(tokens)) == ([1, 2, 2**31 - 1], [], 2)
    assert not list(tmp_path.iterdir())


def test_requests_round_trip_as_shard_records_and_load_apart(tmp_path: Path, monkeypatch):
    """The spill holds the JSON record a shard request holds of its line: every kind of
    params (a seed, a logit bias, a tool call reader) comes back equal, each load its own
    SamplingParams, and the JSON of equal params is cached for at most CACHED_PARAMS kinds."""
    monkeypatch.setattr(request_record, "CACHED_PARAMS", 2)
    shared = SamplingParams(max_tokens=16, temperature=0.0)
    kinds = [
        shared,
        SamplingParams(max_tokens=8, top_p=0.9, temperature=0.7, stop=["\n\n"]),
        SamplingParams(max_tokens=3, seed=7),
        SamplingParams(max_tokens=3, logit_bias={11: -5.0}),
        shared,
    ]
    made = [dataclasses.replace(_request(i + 1), params=p) for i, p in enumerate(kinds)]
    made[1] = dataclasses.replace(made[1], tool_calling=ToolCalling(mode="auto", parser="hermes"))
    store = RequestStore(tmp_path)
    for r in made:
        store.add_line(r, line_digest(r.custom_id.encode()), 1)
    loaded = [store[i] for i in (4, 3, 2, 1, 0)][::-1]
    assert loaded == made
    assert loaded[0].params is not loaded[4].params  # loaded apart: never shared
    assert len(store._params_json) == 2
    [spill] = tmp_path.iterdir()
    assert b"messages" not in spill.read_bytes()  # JSON records, without the text
    assert [json.loads(x)["head"][1] for x in spill.read_bytes().splitlines()] == [
        r.custom_id for r in made
    ]
    store.close()

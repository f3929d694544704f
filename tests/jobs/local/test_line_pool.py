"""The validation pass in chunks, in this process or in a pool of processes
(kvbatch.jobs.local.line_pool), gives the records of a line-by-line pass: the same errors with
the same line numbers (duplicates settled in line order, the job's endpoint and model from its
first valid line), the same token ids, offsets and digests; a chunk whose process dies is
judged again here; and submit writes the same shards either way."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from kvbatch.jobs.distributed.submit import prepare_job
from kvbatch.jobs.local import line_pool
from kvbatch.jobs.local.digest_index import DigestIndex, hex_key, id_number
from kvbatch.jobs.local.line_chunks import line_digest, tokenized
from kvbatch.jobs.local.model_on_demand import GivenModel, ModelOnDemand
from kvbatch.jobs.local.options import JobError, RunOptions
from kvbatch.jobs.local.prepare import JobTraits, PreparedLine, prepare_lines, scan_lines
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.openai_format.prompts import PromptError
from kvbatch.jobs.openai_format.validate import LineError, validate_lines
from kvbatch.jobs.storage import LocalStorage

MAX_LEN = 400
WORDS = "alpha beta the of revenue é 中文 😀 tokens".split()


def _mixed_job(path: Path, n: int, seed: int = 0) -> Path:
    """Chat and completions lines with every kind of trouble a pass settles: broken JSON, blank
    lines, duplicate ids (also of bad lines), another model than the first line's, an embeddings line in a chat job,
    prompts too long, ids outside the vocabulary, one oversized line."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        r = rng.random()
        cid = f"c{i}" if rng.random() > 0.03 else f"c{max(0, i - rng.randrange(1, 300))}"
        text = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 30, 300])))
        if r < 0.03:
            rows.append('{"custom_id": "broken' + str(i) + '", "url": ')
            continue
        if r < 0.05:
            rows.append("")
            continue
        if r < 0.55:
            body = {"messages": [{"role": "system", "content": f"Doc {i % 9} " + "x " * (i % 9)},
                                 {"role": "user", "content": text}],
                    "max_tokens": rng.choice([4, 16, 1000])}  # fmt: skip
            url = "/v1/chat/completions"
            if rng.random() < 0.05:
                body["model"] = "another-model"
            if rng.random() < 0.05:
                body["logit_bias"] = {"42": 3}
        elif r < 0.85:
            body, url = {"prompt": text}, "/v1/completions"
        elif r < 0.95:
            ids = [rng.randrange(0, 60_000) for _ in range(rng.randrange(1, 20))]
            body, url = {"prompt": ids}, "/v1/completions"
        else:
            body, url = {"input": text}, "/v1/embeddings"
        line = {"custom_id": cid, "method": "POST", "url": url, "body": body}
        rows.append(json.dumps(line, ensure_ascii=rng.random() < 0.5))
    rows.insert(n // 2, json.dumps({"custom_id": "huge", "body": "x" * (17 << 20)}))
    first = {"messages": [{"role": "user", "content": "hi"}], "model": "the-model"}
    rows.insert(0, json.dumps({"custom_id": "first", "method": "POST",
                               "url": "/v1/chat/completions", "body": first}))  # fmt: skip
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _line_by_line(path: Path, opts: RunOptions, model, done: dict) -> list:
    """The pass as a loop over validate_lines, one line tokenized at a time."""
    traits = JobTraits(opts)
    out, offset = [], 0
    raws = path.read_bytes().splitlines(keepends=True)
    offsets = {}
    for number, raw in enumerate(raws, start=1):
        offsets[number] = (offset, len(raw), raw)
        offset += len(raw)
    for item in validate_lines(raws, model=opts.model_name):
        if isinstance(item, LineError):
            out.append(item)
            continue
        mismatch = traits.endpoint.check(item) or traits.model_error(item)
        if mismatch is not None:
            out.append(mismatch)
            continue
        start, size, raw = offsets[item.line]
        if done.get(item.custom_id) == line_digest(raw):
            out.append(("answered", item.custom_id, item.line))
            continue
        try:
            request, inputs = tokenized(item, model)
        except PromptError as e:
            out.append(e.line_error(item))
            continue
        out.append((request, [list(ids) for ids in inputs], start, size, line_digest(raw)))
    return out


def _done_index(done: dict) -> DigestIndex:
    """{custom_id: line digest} as PartialOutput.recover gives it."""
    index = DigestIndex()
    for custom_id, digest in done.items():
        index.add(hex_key(digest), id_number(custom_id))
    return index


def _scanned(path: Path, opts: RunOptions, model, done: dict) -> list:
    out = []
    traits = JobTraits(opts)
    for item in scan_lines(LocalStorage(str(path)), opts, model, _done_index(done), traits):
        if isinstance(item, PreparedLine):
            inputs = [list(ids) for ids in item.inputs]
            out.append((item.request, inputs, item.offset, item.size, item.digest))
        elif isinstance(item, LineError):
            out.append(item)
        else:
            out.append(("answered", item.custom_id, item.line))
    return out


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from transformers import AutoTokenizer

    return GivenModel(AutoTokenizer.from_pretrained(str(smollm2_dir)), MAX_LEN)


@pytest.fixture
def pool_from_the_start(monkeypatch):
    monkeypatch.setattr(line_pool, "POOL_AFTER_LINES", 0)


def test_chunks_here_and_in_a_pool_give_the_line_by_line_records(
    tmp_path: Path, model, pool_from_the_start
):
    path = _mixed_job(tmp_path / "in.jsonl", 1_200)
    # An earlier run answered some lines; one of its answers has the bytes of another line
    # (the same digest, another custom_id): that line is tokenized after all.
    done = {}
    for k, raw in enumerate(path.read_bytes().splitlines(keepends=True)):
        try:
            cid = json.loads(raw)["custom_id"]
        except (ValueError, KeyError):
            continue
        if k % 7 == 0:
            done[cid] = line_digest(raw)
        elif k % 7 == 1 and "c-elsewhere" not in done:
            done["c-elsewhere"] = line_digest(raw)
    expected = _line_by_line(path, RunOptions(input=str(path), model="m"), model, done)
    kinds = {x[0] if isinstance(x, tuple) and x[0] == "answered" else type(x).__name__
             for x in expected}  # fmt: skip
    assert kinds == {"LineError", "answered", "tuple"} and len(expected) > 1_100
    codes = {x.code for x in expected if isinstance(x, LineError)}
    assert codes >= {"invalid_json", "duplicate_custom_id", "line_too_long", "invalid_url",
                     "model_mismatch", "context_length_exceeded", "invalid_prompt"}  # fmt: skip
    for workers in (1, 2):
        opts = RunOptions(input=str(path), model="m", tokenize_workers=workers)
        assert _scanned(path, opts, model, done) == expected, f"{workers} workers"


def test_a_process_that_dies_leaves_its_chunk_to_this_one(
    tmp_path: Path, model, pool_from_the_start, monkeypatch, caplog
):
    path = _mixed_job(tmp_path / "in.jsonl", 900, seed=3)
    opts = RunOptions(input=str(path), model="m", tokenize_workers=2)
    expected = _line_by_line(path, opts, model, {})
    judge = line_pool._judge_in_worker

    def dies_at_its_second_chunk(first, raws, skip):
        if first > line_pool.CHUNK_LINES:
            os._exit(3)  # as the OOM killer would end it
        return judge(first, raws, skip)

    monkeypatch.setattr(line_pool, "_judge_in_worker", dies_at_its_second_chunk)
    with caplog.at_level("WARNING", logger="kvbatch.run"):
        assert _scanned(path, opts, model, {}) == expected
    assert "judged in this process" in caplog.text


def test_submit_writes_the_same_shards_with_and_without_a_pool(
    tmp_path: Path, tiny_chat_model: Path, pool_from_the_start, monkeypatch
):
    path = _mixed_job(tmp_path / "in.jsonl", 700, seed=5)
    shards = []
    for workers in ("1", "2"):
        monkeypatch.setenv(line_pool.WORKERS_ENV, workers)
        job = prepare_job(str(path), str(tmp_path / workers), str(tiny_chat_model),
                          max_model_len=MAX_LEN, shard_tokens=3_000, job_id="j")  # fmt: skip
        errors = (tmp_path / workers / "j" / "validation_errors.jsonl").read_bytes()
        shards.append(([m.sha256 for m in job.messages], errors, job.num_requests))
    assert shards[0] == shards[1]
    assert len(shards[0][0]) > 3 and shards[0][2] > 300


def test_a_bad_number_of_processes_is_named(tmp_path: Path, model, monkeypatch):
    path = _mixed_job(tmp_path / "in.jsonl", 5)
    monkeypatch.setenv(line_pool.WORKERS_ENV, "many")
    opts = RunOptions(input=str(path), model="m")
    with pytest.raises(JobError, match="KVBATCH_TOKENIZE_WORKERS='many'"):
        _scanned(path, opts, model, {})


def test_kvbatch_runs_pass_uses_the_pool_once_it_has_read_the_model(
    tmp_path: Path, tiny_chat_model: Path, pool_from_the_start, monkeypatch
):
    """kvbatch run reads the tokenizer when a line first needs it (ModelOnDemand): the pool
    starts with the next chunk, and the prepared job is the one of a pass without it."""
    path = _mixed_job(tmp_path / "in.jsonl", 800, seed=7)
    started = []
    start = line_pool.JudgedLines._maybe_start_pool

    def noting_the_pool(self, lines_done):
        start(self, lines_done)
        if self.pool is not None and not started:
            started.append(lines_done)

    monkeypatch.setattr(line_pool.JudgedLines, "_maybe_start_pool", noting_the_pool)
    jobs = []
    for workers in (1, 2):
        opts = RunOptions(input=str(path), model=str(tiny_chat_model), tokenize_workers=workers)
        with TokenStore(tmp_path) as store:
            source = LocalStorage(str(path))
            job = prepare_lines(source, opts, ModelOnDemand(opts), store, DigestIndex())
            tokens = [store[i] for i in range(len(store))]
            requests = [job.requests[i] for i in range(len(job.requests))]
            digests = [job.requests.digest(i) for i in range(len(job.requests))]
            inputs = [job.requests.input_index(i) for i in range(len(job.requests))]
            jobs.append((requests, digests, inputs, list(job.errors), tokens))
            job.close()
    assert started == [line_pool.CHUNK_LINES]  # the first chunk read the model
    assert jobs[0] == jobs[1]
    assert len(jobs[0][0]) > 300

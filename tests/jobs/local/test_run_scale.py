"""`kvbatch run` at scale: memory that does not grow with the lines beyond the prefix trie's
hashes and a few integers a line, and a bad line deep in a big file.

The memory test fails if a per-line Python object list comes back (a JobRequest, a dict entry
by custom_id, an error record or a finalize tuple per line, kept for the whole job): the peak
traced allocation of a 4k-line run may exceed the 1k-line one's only by the trie's nodes
(measured on the same prompts, by grouping them alone) and BYTES_PER_LINE. The engine is
loaded once, before either run, so neither peak holds the tokenizer or the model."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from kvbatch.bench.submit_workload import write_chat_job
from kvbatch.jobs.grouping import group_by_prefix
from kvbatch.jobs.local.digest_index import DigestIndex
from kvbatch.jobs.local.run import RunOptions, prepare_requests, run_job
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.storage import LocalStorage

# What a line may keep beyond the 1k-line job's peak besides the trie's nodes: its token-store
# and request-store rows, its custom_id's digest and the order's integers (some 90 bytes; the
# peaks differ by about 80 bytes a line in all, as the small job's peak is not its trie's). A
# JobRequest kept a line adds some 400; the JobRequest, digest and line-number dicts that run
# used to keep, about 500.
BYTES_PER_LINE = 100
BAD_LINE = b'{"custom_id": "broken", "method": "POST", "url": '


@pytest.fixture(scope="module")
def llm(tiny_chat_model: Path):
    from kvbatch.engine import LLM

    # A KV pool of fixed size: its prefix index is bounded by the pool, not by the job.
    return LLM(model=str(tiny_chat_model), max_model_len=512, max_num_seqs=64, num_kv_blocks=1024)


def _peak_of_run(opts: RunOptions, llm) -> tuple[int, object]:
    tracemalloc.start()
    try:
        record = run_job(opts, llm)
        return tracemalloc.get_traced_memory()[1], record
    finally:
        tracemalloc.stop()


def _peak_of_grouping(src: Path, llm, tmp_path: Path) -> int:
    """The peak traced allocation of the prefix trie over the job's prompts, alone."""
    opts = RunOptions(input=str(src), model="unused")
    engine = llm.engine
    with TokenStore(tmp_path) as store:
        job = prepare_requests(LocalStorage(str(src)), opts, engine.tokenizer,
                               engine.max_model_len, store, DigestIndex())  # fmt: skip
        job.close()
        prompts = [store[i] for i in range(len(store))]
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        group_by_prefix(iter(prompts), engine.config.cache.block_size)
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def _job(tmp_path: Path, name: str, lines: int, **kw) -> RunOptions:
    src = write_chat_job(tmp_path / f"{name}.jsonl", lines, words=20, max_tokens=1, **kw)
    return RunOptions(input=str(src), model="unused", output=str(tmp_path / f"{name}.out.jsonl"),
                      tokenize_workers=1)  # fmt: skip


@pytest.mark.slow  # runs 5k lines through the engine under tracemalloc
def test_run_memory_does_not_grow_with_the_lines(tmp_path: Path, llm):
    _peak_of_run(_job(tmp_path, "warm", 50), llm)  # imports, the engine's first steps
    small = _job(tmp_path, "small", 1_000)
    big = _job(tmp_path, "big", 4_000, bad_lines={3_900: BAD_LINE})
    peak_small, _ = _peak_of_run(small, llm)
    peak_big, record = _peak_of_run(big, llm)
    grown = (peak_big - peak_small) / 3_000
    trie = (
        _peak_of_grouping(Path(big.input), llm, tmp_path)
        - _peak_of_grouping(Path(small.input), llm, tmp_path)
    ) / 3_000
    assert grown < trie + BYTES_PER_LINE, (
        f"{grown:.0f} bytes a line more, the trie's {trie:.0f}: a per-line list is back"
    )
    # Every other line answered once, in input order; the malformed one is an error record
    # with its line number.
    assert (record.completed, record.failed) == (3_999, 1)
    out = [json.loads(x)["custom_id"] for x in Path(big.output).read_bytes().splitlines()]
    assert out == [f"req-{i}" for i in range(4_000) if i != 3_899]
    errors = Path(big.output.replace(".out.jsonl", ".out.errors.jsonl")).read_bytes()
    assert [json.loads(e)["error"]["line"] for e in errors.splitlines()] == [3_900]

"""`kvbatch submit` at scale: memory that does not grow with the lines' text, a bad line deep in
a big file, and a submit that a failure while writing shards leaves for a rerun to complete.

The memory test fails if a per-line Python object list comes back (a JobRequest, a token list
or a shard request per line, kept for the whole job): the peak traced allocation of an
8k-line submit may exceed the 1k-line one's only by what the job keeps per line by design:
the prefix trie's nodes (measured on the same prompts, by grouping them alone), and a row of
integers and the custom_ids seen (BYTES_PER_LINE)."""

from __future__ import annotations

import json
import subprocess
import tracemalloc
from pathlib import Path

import pytest

from kvbatch.bench.submit_workload import write_chat_job
from kvbatch.jobs.distributed import submit
from kvbatch.jobs.distributed.shards import read_shard
from kvbatch.jobs.distributed.submit import prepare_job
from kvbatch.jobs.grouping import group_by_prefix
from kvbatch.jobs.local import line_pool
from kvbatch.jobs.local.run import JobError
from kvbatch.jobs.storage.s3 import reset_client
from tests.fault_proxy import FaultProxy
from tests.s3_server import s3_server  # noqa: F401

# What a line may keep beyond the 1k-line job's peak besides the trie's nodes: a row of
# integers (about 60 bytes) and its custom_id's digest among the ids seen (24 bytes once
# merged, more while the newest wait in a dict: jobs/local/digest_index.py); 146 measured in
# all. A JobRequest and two dict entries a line, as submit used to keep, came to over 500.
BYTES_PER_LINE = 200
BAD_LINE = b'{"custom_id": "broken", "method": "POST", "url": '


def _peak_of_submit(src: Path, out: Path, model: Path) -> tuple[int, object]:
    tracemalloc.start()
    try:
        job = prepare_job(str(src), str(out), str(model), max_model_len=2048,
                          shard_tokens=20_000, job_id="j")  # fmt: skip
        return tracemalloc.get_traced_memory()[1], job
    finally:
        tracemalloc.stop()


def _peak_of_grouping(prompts: list[list[int]]) -> int:
    """The peak traced allocation of the prefix trie over `prompts` (given), alone."""
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        group_by_prefix(iter(prompts), 16)
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


def _prompts(job) -> list[list[int]]:
    requests = sorted((r for m in job.messages for r in read_shard(m)), key=lambda r: r.index)
    return [r.prompt_token_ids for r in requests]


def test_submit_memory_does_not_grow_with_the_lines(
    tmp_path: Path, tiny_chat_model: Path, monkeypatch
):
    # Loading the tokenizer (some 20 MB of Python objects, the same for any job) would be the
    # peak of both jobs: the peak is counted from after it.
    read_model = submit._read_model

    def read_model_then_reset_peak(*args):
        loaded = read_model(*args)
        tracemalloc.reset_peak()
        return loaded

    monkeypatch.setattr(submit, "_read_model", read_model_then_reset_peak)
    # Both jobs judged by the pool of processes from their first line (a long job's way): its
    # chunks in flight are the same few megabytes whatever the job's size.
    monkeypatch.setattr(line_pool, "POOL_AFTER_LINES", 0)
    monkeypatch.setenv(line_pool.WORKERS_ENV, "2")
    small = write_chat_job(tmp_path / "small.jsonl", 1_000, words=20)
    big = write_chat_job(tmp_path / "big.jsonl", 8_000, words=20, bad_lines={7_900: BAD_LINE})
    _peak_of_submit(write_chat_job(tmp_path / "warm.jsonl", 50), tmp_path / "warm",
                    tiny_chat_model)  # imports  # fmt: skip
    peak_small, small_job = _peak_of_submit(small, tmp_path / "small", tiny_chat_model)
    peak_big, job = _peak_of_submit(big, tmp_path / "big", tiny_chat_model)
    grown = (peak_big - peak_small) / 7_000
    trie = (_peak_of_grouping(_prompts(job)) - _peak_of_grouping(_prompts(small_job))) / 7_000
    assert grown < trie + BYTES_PER_LINE, (
        f"{grown:.0f} bytes a line more, the trie's {trie:.0f}: a per-line list is back"
    )
    # The malformed line deep in the file is one error record with its line number.
    assert (job.num_requests, job.num_invalid) == (7_999, 1)
    errors = (tmp_path / "big" / "j" / "validation_errors.jsonl").read_bytes().splitlines()
    assert [json.loads(e)["error"]["line"] for e in errors] == [7_900]
    # Every answered line is in exactly one shard, once, with its own line number.
    seen = [(r.index, r.line) for m in job.messages for r in read_shard(m)]
    assert sorted(i for i, _ in seen) == list(range(7_999))
    assert {line for _, line in seen} == set(range(1, 8_001)) - {7_900}


@pytest.fixture
def proxy(s3_server, monkeypatch):  # noqa: F811
    proxy = FaultProxy(s3_server.endpoint).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)  # kvbatch's S3 goes through it
    reset_client()
    try:
        yield proxy
    finally:
        proxy.stop()
        reset_client()


def test_s3_failure_writing_shards_then_the_same_job_id_completes(
    tmp_path: Path,
    s3_server,  # noqa: F811
    proxy: FaultProxy,
    tiny_chat_model: Path,
):
    """S3 refuses a shard's payload mid-way (403, not retried): no job.json, no message, an
    error naming the job id; the same submit with that job id then writes every shard once,
    the same bytes as a job that never failed. The input is read from S3 too."""
    bucket = s3_server.make_bucket()
    src = write_chat_job(tmp_path / "in.jsonl", 300, words=30)
    s3_server.client().put_object(Bucket=bucket, Key="in.jsonl", Body=src.read_bytes())
    kw = {"max_model_len": 2048, "shard_tokens": 2_000}
    clean = prepare_job(f"s3://{bucket}/in.jsonl", f"s3://{bucket}/clean", str(tiny_chat_model),
                        job_id="j", **kw)  # fmt: skip
    assert len(clean.messages) >= 4
    refused = proxy.fail("PUT", r"/failing/j/shards/shard-00002\.jsonl$", status=403,
                         code="AccessDenied")  # fmt: skip
    with pytest.raises(JobError) as e:
        prepare_job(f"s3://{bucket}/in.jsonl", f"s3://{bucket}/failing", str(tiny_chat_model),
                    job_id="j", **kw)  # fmt: skip
    assert refused.hits == 1
    assert "shard 3 of" in str(e.value) and "--job-id j" in str(e.value)
    assert "No shard was sent" in str(e.value)
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert "failing/j/job.json" not in keys
    proxy.rules.clear()
    done = prepare_job(f"s3://{bucket}/in.jsonl", f"s3://{bucket}/failing", str(tiny_chat_model),
                       job_id="j", **kw)  # fmt: skip
    assert [m.shard_id for m in done.messages] == [m.shard_id for m in clean.messages]
    assert [m.sha256 for m in done.messages] == [m.sha256 for m in clean.messages]
    manifest = json.loads(
        s3_server.client().get_object(Bucket=bucket, Key="failing/j/job.json")["Body"].read()
    )
    assert [s["shard_id"] for s in manifest["shards"]] == [m.shard_id for m in done.messages]
    with pytest.raises(JobError, match="already exists"):  # complete now: never twice
        prepare_job(f"s3://{bucket}/in.jsonl", f"s3://{bucket}/failing", str(tiny_chat_model),
                    job_id="j", **kw)  # fmt: skip


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 200 KB tmpfs (a full disk for real): where mounting is not allowed (not root, no
    CAP_SYS_ADMIN), the S3 test above covers the same path."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(folder)],
                             capture_output=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_full_disk_writing_shards_then_the_same_job_id_completes(
    tmp_path: Path, small_disk: Path, tiny_chat_model: Path
):
    src = write_chat_job(tmp_path / "in.jsonl", 600, words=30)
    kw = {"max_model_len": 2048, "shard_tokens": 2_000, "job_id": "j"}
    with pytest.raises(JobError, match=r"No space left on device.*--job-id j"):
        prepare_job(str(src), str(small_disk / "out"), str(tiny_chat_model), **kw)
    assert not (small_disk / "out" / "j" / "job.json").exists()
    subprocess.run(["mount", "-o", "remount,size=20m", str(small_disk)], check=True)
    done = prepare_job(str(src), str(small_disk / "out"), str(tiny_chat_model), **kw)
    clean = prepare_job(str(src), str(tmp_path / "clean"), str(tiny_chat_model), **kw)
    assert [m.sha256 for m in done.messages] == [m.sha256 for m in clean.messages]
    assert done.num_requests == 600

"""kvbatch.jobs.distributed.submit.prepare_job and kvbatch.jobs.distributed.shards: validation, prefix shards cut on group boundaries,
claim-check messages, payload integrity, safe job ids."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvbatch.jobs.distributed.shards import ShardMessage, job_dir, new_job_id, read_shard
from kvbatch.jobs.distributed.submit import cut_shards, prepare_job, shared_leading_blocks
from kvbatch.jobs.local.run import JobError
from kvbatch.jobs.storage import open_storage
from tests.jobs.local.test_run import chat, completion, read_jsonl, write_jsonl

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


def rag_lines(seed: int = 0) -> list:
    """A shuffled RAG-like job: 4 documents x 4 questions, a few singletons, and bad lines."""
    docs = [" ".join(f"{WORDS[(d * 7 + k) % len(WORDS)]}{k}" for k in range(40)) for d in range(4)]
    lines: list = []
    for d, doc in enumerate(docs):
        for q in range(4):
            lines.append(
                chat(
                    f"doc{d}-q{q}",
                    "",
                    messages=[
                        {"role": "system", "content": f"Answer from this document.\n{doc}"},
                        {"role": "user", "content": f"question {q} about part {q * 5}?"},
                    ],
                    max_tokens=4,
                )
            )
    lines += [completion(f"solo{i}", f"{WORDS[i]} once upon a time") for i in range(3)]
    random.Random(seed).shuffle(lines)
    lines.insert(3, "{not json")
    lines.insert(7, chat("doc0-q0", "duplicate id"))
    lines.insert(10, chat("too-long", " ".join(["word"] * (MAX_MODEL_LEN + 20))))
    return lines


def prepare(tmp_path: Path, model: Path, lines: list, **kw):
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    kw = {"block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN, "model_name": "tiny-chat", **kw}
    return prepare_job(str(src), str(tmp_path / "out"), str(model), **kw)


def test_cut_shards_takes_whole_groups_up_to_the_budget():
    lengths = [10, 10, 30, 5, 5, 100, 1]
    shared = [0, 3, 0, 0, 2, 0, 0]  # groups: [10 10] [30] [5 5] [100] [1]
    assert cut_shards(lengths, shared, 50) == [(0, 3), (3, 5), (5, 6), (6, 7)]
    assert cut_shards(lengths, shared, 1000) == [(0, 7)]
    assert cut_shards([], [], 10) == []
    with pytest.raises(ValueError):
        cut_shards(lengths, shared, 0)


def test_a_group_bigger_than_a_shard_is_cut_where_least_is_shared():
    # One top-level group (a shared system prompt: 1 block), made of two documents (3 blocks).
    lengths = [40] * 8
    shared = [0, 3, 3, 3, 1, 3, 3, 3]
    assert cut_shards(lengths, shared, 200) == [(0, 4), (4, 8)]
    # Smaller shards still cut at document boundaries first, then inside a document.
    assert cut_shards(lengths, shared, 130) == [(0, 3), (3, 4), (4, 7), (7, 8)]


def test_shared_leading_blocks_counts_common_full_blocks():
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    c = [7] * 40
    assert shared_leading_blocks([a, b, c, c[:15]], 16) == [0, 2, 0, 0]


def test_prepare_job_cuts_shards_on_group_boundaries(tmp_path: Path, tiny_chat_model: Path):
    lines = rag_lines()
    shard_tokens = 400
    job = prepare(tmp_path, tiny_chat_model, lines, shard_tokens=shard_tokens, job_id="job-1")
    assert job.job_id == "job-1" and job.num_requests == 19 and job.num_invalid == 3
    folder = open_storage(job.dir_uri)
    manifest = json.loads(folder.join("job.json").open_read().read())
    assert manifest["num_requests"] == 19 and manifest["model_name"] == "tiny-chat"
    assert [s["shard_id"] for s in manifest["shards"]] == [m.shard_id for m in job.messages]
    assert len(job.messages) >= 3
    batch = json.loads(folder.join("batch.json").open_read().read())
    assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 22

    errors = read_jsonl(Path(job.dir_uri) / "validation_errors.jsonl")
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [
        (4, "invalid_json"),
        (8, "duplicate_custom_id"),
        (11, "context_length_exceeded"),
    ]

    seen_index, shards = set(), []
    for msg, entry in zip(job.messages, manifest["shards"]):
        body = json.dumps(msg.to_dict())
        assert set(msg.to_dict()) == {"job_id", "shard_id", "uri", "sha256"}
        assert "question" not in body and len(body) < 300  # a pointer, never the prompts
        assert ShardMessage.from_dict(json.loads(body)) == msg
        reqs = read_shard(msg)
        assert len(reqs) == entry["num_requests"]
        assert sum(len(r.prompt_token_ids) for r in reqs) == entry["prompt_tokens"]
        seen_index.update(r.index for r in reqs)
        shards.append([r.prompt_token_ids for r in reqs])
    assert seen_index == set(range(19))
    # Every cut is at a least-shared point of the window it closed, and a shard overflows only
    # when it is a single request.
    ordered = [p for shard in shards for p in shard]
    shared = shared_leading_blocks(ordered, BLOCK_SIZE)
    begin = 0
    for shard in shards:
        end = begin + len(shard)
        tokens = sum(map(len, shard))
        assert tokens <= shard_tokens or len(shard) == 1
        if end < len(ordered):
            window = range(begin + 1, end + 1)
            assert shared[end] == min(shared[j] for j in window)
        begin = end
    assert any(len(shard) > 1 for shard in shards)


def test_tampered_payload_is_refused(tmp_path: Path, tiny_chat_model: Path):
    job = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=10_000)
    msg = job.messages[0]
    path = Path(msg.uri)
    path.write_bytes(path.read_bytes().replace(b'"max_tokens":4', b'"max_tokens":9'))
    with pytest.raises(ValueError, match="does not match its sha256"):
        read_shard(msg)


@pytest.mark.parametrize("bad", ["..", "a/b", "../x", "", "job id"])
def test_unsafe_job_ids_are_rejected(tmp_path: Path, bad: str):
    with pytest.raises(ValueError, match=r"job id .* cannot name a job: .*kvbatch submit"):
        job_dir(str(tmp_path), bad)
    with pytest.raises(JobError, match="cannot name a job"):
        prepare_job(str(tmp_path / "missing.jsonl"), str(tmp_path), "unused", job_id=bad)
    good = {
        "job_id": "job-1",
        "shard_id": "s1",
        "uri": "x/job-1/shards/s1.jsonl",
        "sha256": "0" * 64,
    }
    with pytest.raises(ValueError):
        ShardMessage.from_dict({**good, "job_id": bad})
    with pytest.raises(ValueError):
        ShardMessage.from_dict({**good, "shard_id": bad})


def test_messages_are_checked():
    good = {
        "job_id": "job-1",
        "shard_id": "s1",
        "uri": "x/job-1/shards/s1.jsonl",
        "sha256": "a" * 64,
    }
    assert ShardMessage.from_dict(good).to_dict() == good
    for bad in ({"sha256": "xyz"}, {"uri": "/etc/passwd"}, {"uri": "x/job-2/shards/s1.jsonl"}):
        with pytest.raises(ValueError):
            ShardMessage.from_dict({**good, **bad})
    with pytest.raises(ValueError, match="lacks"):
        ShardMessage.from_dict({"job_id": "job-1"})
    job_id = new_job_id()
    assert job_id.startswith("job-") and len(job_id) == len("job-20250101-120000-abcd1234")


def test_storage_problems_fail_before_any_work(tmp_path: Path):
    with pytest.raises(JobError, match="not found"):
        prepare_job(str(tmp_path / "missing.jsonl"), str(tmp_path / "out"), "unused")
    src = write_jsonl(tmp_path / "in.jsonl", [chat("a", "hi")])
    (tmp_path / "file").write_text("")
    with pytest.raises(JobError):
        prepare_job(str(src), str(tmp_path / "file"), "unused", job_id="j")


def test_existing_job_id_is_refused(tmp_path: Path, tiny_chat_model: Path):
    prepare(tmp_path, tiny_chat_model, [chat("a", "hi")], job_id="same")
    with pytest.raises(JobError, match="already exists"):
        prepare(tmp_path, tiny_chat_model, [chat("a", "hi")], job_id="same")

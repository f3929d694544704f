"""Prefill stays at the ideal (hypothesis): on random two-level jobs (a shared system prompt,
documents, chunks of each, shuffled; n = 1 or 2; short answers) whose groups fit the KV cache,
the prompt tokens served from the prefix cache equal the ideal of the job's depth-first order
(kvbatch.jobs.grouping.group_by_prefix), through `kvbatch run` and through a worker's shards.

"Fit" means the pool holds the system prompt, the largest document's group and every running
sequence at full length at once, yet not every distinct prefix of the job: blocks are evicted,
and only the depth-first order keeps LRU from evicting a prefix still to be read."""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.engine.kv.kv_cache import block_hashes
from kvbatch.jobs.distributed.finalize import read_manifest
from kvbatch.jobs.distributed.shards import job_dir, run_shard
from kvbatch.jobs.distributed.submit import prepare_job
from kvbatch.jobs.grouping import group_by_prefix
from kvbatch.jobs.local.run import RunOptions, resolve_paths, run_job
from tests.jobs.local.test_run import write_jsonl

BLOCK_SIZE = 16
MAX_NUM_SEQS = 2
MAX_ANSWER = 6
MODEL_NAME = "tiny-chat"


@dataclass(frozen=True)
class TwoLevelJob:
    system: list[int]
    documents: list[list[int]]
    chunks: list[list[list[int]]]  # per document
    lines: list[dict]  # shuffled
    prompts: list[list[int]]  # in the order of `lines`

    def blocks_that_fit(self) -> int:
        """A pool that holds the system prompt, the largest document group and MAX_NUM_SEQS
        sequences at full length (n = 2 forks the last partial block: one more each)."""
        blocks = -(-len(self.system) // BLOCK_SIZE)
        group = max(
            -(-(len(d) + sum(len(c) for c in cs)) // BLOCK_SIZE) + len(cs)
            for d, cs in zip(self.documents, self.chunks)
        )
        running = MAX_NUM_SEQS * (-(-self.max_model_len() // BLOCK_SIZE) + 2)
        return blocks + group + running

    def max_model_len(self) -> int:
        return max(len(p) for p in self.prompts) + MAX_ANSWER

    def distinct_blocks(self) -> int:
        """Full blocks of distinct prefixes: what a pool that never evicts would hold."""
        return len({h for p in self.prompts for h in block_hashes(p, BLOCK_SIZE)})


@st.composite
def two_level_jobs(draw) -> TwoLevelJob:
    rng = random.Random(draw(st.integers(0, 2**32)))
    vocab = range(3, 49152)
    system = rng.choices(vocab, k=draw(st.integers(1, 3 * BLOCK_SIZE)))
    documents, chunks, lines, prompts = [], [], [], []
    for d in range(draw(st.integers(1, 6))):
        documents.append(rng.choices(vocab, k=draw(st.integers(BLOCK_SIZE, 6 * BLOCK_SIZE))))
        chunks.append(
            [
                rng.choices(vocab, k=draw(st.integers(1, 2 * BLOCK_SIZE)))
                for _ in range(draw(st.integers(1, 4)))
            ]
        )
        for c, chunk in enumerate(chunks[-1]):
            prompt = system + documents[-1] + chunk
            body = {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": draw(st.integers(1, MAX_ANSWER)),
                "temperature": 0,
                "n": draw(st.sampled_from([1, 2])),
            }
            lines.append(
                {
                    "custom_id": f"d{d}-c{c}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": body,
                }
            )
            prompts.append(prompt)
    order = draw(st.permutations(range(len(lines))))
    return TwoLevelJob(
        system, documents, chunks, [lines[i] for i in order], [prompts[i] for i in order]
    )


def engine_for(model: Path, job: TwoLevelJob):
    from kvbatch.engine import LLM

    return LLM(
        model=str(model),
        device="cpu",
        max_model_len=job.max_model_len(),
        max_num_seqs=MAX_NUM_SEQS,
        block_size=BLOCK_SIZE,
        num_kv_blocks=job.blocks_that_fit(),
    )


JOBS = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@JOBS
@given(job=two_level_jobs())
def test_kvbatch_run_computes_the_ideal_prefill(tiny_chat_model: Path, job: TwoLevelJob):
    ideal = group_by_prefix(job.prompts, BLOCK_SIZE).ideal_cached_tokens
    with tempfile.TemporaryDirectory() as tmp:
        src = write_jsonl(Path(tmp) / "in.jsonl", job.lines)
        opts = RunOptions(input=str(src), model="unused", work_dir=str(Path(tmp) / "work"))
        llm = engine_for(tiny_chat_model, job)
        record = run_job(opts, llm=llm)
        assert record.status == "completed"
        batch = json.loads(Path(resolve_paths(opts).batch).read_text())
    assert batch["request_counts"]["failed"] == 0
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] == ideal
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@JOBS
@given(job=two_level_jobs())
def test_a_workers_shards_compute_the_ideal_prefill(tiny_chat_model: Path, job: TwoLevelJob):
    with tempfile.TemporaryDirectory() as tmp:
        src = write_jsonl(Path(tmp) / "in.jsonl", job.lines)
        sub = prepare_job(
            str(src),
            str(Path(tmp) / "out"),
            str(tiny_chat_model),
            model_name=MODEL_NAME,
            block_size=BLOCK_SIZE,
            max_model_len=job.max_model_len(),
            shard_tokens=10_000,
        )
        manifest = read_manifest(job_dir(str(Path(tmp) / "out"), sub.job_id))
        llm = engine_for(tiny_chat_model, job)
        cached = 0
        for msg in sub.messages:
            for _, line in run_shard(
                llm, msg, model_name=manifest["model_name"], batch_id=manifest["batch_id"]
            ):
                assert line["error"] is None, line["error"]
                usage = line["response"]["body"]["usage"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == manifest["ideal_cached_tokens"]
    assert manifest["ideal_cached_tokens"] == group_by_prefix(job.prompts).ideal_cached_tokens


def test_a_job_like_the_issues_does_not_fit_whole():
    """A shared system prompt, 16 documents of 256 tokens, 6 chunks each: the pool the
    property sizes holds far fewer blocks than the job's distinct prefixes, so it evicts."""
    system = [5] * 64
    prompts = [system + [10 + d] * 256 + [100 + c] * 20 for d in range(16) for c in range(6)]
    documents = [[10 + d] * 256 for d in range(16)]
    chunks = [[[100 + c] * 20 for c in range(6)] for _ in range(16)]
    job = TwoLevelJob(system, documents, chunks, lines=[], prompts=prompts)
    assert job.blocks_that_fit() * 3 < job.distinct_blocks()

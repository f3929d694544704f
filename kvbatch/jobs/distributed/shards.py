"""Shards of a distributed job: their payloads in storage and the small messages that point
at them (claim check: a queue message carries `{job_id, shard_id, uri, sha256}`, never a
prompt).

    <output>/<job_id>/shards/<shard_id>.jsonl   one ShardRequest per line, in prefix order
    <output>/<job_id>/shards/<shard_id>.lines.jsonl   [index, line, custom_id] per request: what
                                                a failed shard's error records need when its
                                                payload itself cannot be read (access denied)
    ShardMessage(job_id, shard_id, uri, sha256)  what goes on the queue

`run_shard` is the engine part of a worker's task: read the payload (checking its sha256),
run it in the shard's prefix order through the answer loop `kvbatch run` uses too
(kvbatch.jobs.answering), and return one output or error line per request, keyed by the
request's position in the job (`index`) so finalize can restore input order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvbatch.engine import SamplingParams
from kvbatch.jobs.answering import EngineRequest, LineContext, answer
from kvbatch.jobs.distributed.cancelled import cancelled_line
from kvbatch.jobs.openai_format.validate import JobRequest
from kvbatch.jobs.request_record import job_request_of, sampling_params_of
from kvbatch.jobs.storage import Storage, open_storage, validate_key_part

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ShardMessage:
    """The queue message of one shard: JSON only, small."""

    job_id: str
    shard_id: str
    uri: str  # the payload: <output>/<job_id>/shards/<shard_id>.jsonl
    sha256: str  # of the payload's bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ShardMessage:
        """Parse and check a message from the queue: ids are safe key parts, the sha256 is
        hex, and the uri is the shard's own payload under its job (never anything else)."""
        if not isinstance(d, dict):
            raise ValueError(f"a shard message must be a JSON object, got {type(d).__name__}")
        missing = [k for k in ("job_id", "shard_id", "uri", "sha256") if k not in d]
        if missing:
            raise ValueError(f"shard message lacks {', '.join(missing)}: {d!r}")
        job_id = validate_key_part(d["job_id"])
        shard_id = validate_key_part(d["shard_id"])
        sha, uri = d["sha256"], d["uri"]
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise ValueError(f"shard message sha256 {sha!r} is not 64 lowercase hex digits")
        if not isinstance(uri, str) or not uri.endswith(f"/{job_id}/shards/{shard_id}.jsonl"):
            raise ValueError(
                f"shard message uri {uri!r} is not the payload of shard {shard_id} of {job_id}"
            )
        return cls(job_id, shard_id, uri, sha)


@dataclass(frozen=True)
class EmbeddingSpec:
    """What an embeddings line carries in a shard: every input (one engine request each, run
    in the same shard so the line is answered whole) and how its answer carries them."""

    inputs: list[list[int]]
    dimensions: int | None
    encoding_format: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ScoreSpec:
    """What a score or rerank line carries in a shard: every pair's prompt (one engine request
    each, run in the same shard so the line is answered whole), the documents a rerank answer
    shows, and how many it keeps."""

    inputs: list[list[int]]
    documents: list[str] | None
    top_n: int | None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ShardRequest:
    """One line of a shard payload: a validated, tokenized request, without its text."""

    index: int  # position in the job (0-based among valid lines): output order
    line: int  # 1-based input line
    custom_id: str
    url: str
    prompt_token_ids: list[int]
    params: dict  # dataclasses.asdict(SamplingParams), max_tokens already capped
    logprobs: int | None
    max_tokens: int | None
    model: str | None
    embedding: dict | None = None  # EmbeddingSpec.to_dict() of an embeddings line
    # ToolCalling as a dict: how a chat answer is read for tool calls (the submit's
    # --tool-call-parser travels in it, so every worker reads answers alike)
    tool_calling: dict | None = None
    score: dict | None = None  # ScoreSpec.to_dict() of a score or rerank line

    def to_dict(self) -> dict:
        """The fields as they are (the params and specs are dicts already): asdict would copy
        every token id of the prompt one by one."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> ShardRequest:
        return cls(**d)

    def embedding_spec(self) -> EmbeddingSpec | None:
        return None if self.embedding is None else EmbeddingSpec(**self.embedding)

    def engine_requests(self) -> list[EngineRequest]:
        """What the answer loop runs for this line (keyed by its index in the job): one
        request, or one per embeddings input or scored pair (params None: the answer loop
        gives a pair its engine's kind)."""
        if self.score is not None:
            pairs = self.score["inputs"]
            return [EngineRequest(self.index, i, ids, None) for i, ids in enumerate(pairs)]
        spec = self.embedding_spec()
        if spec is None:
            return [EngineRequest(self.index, 0, self.prompt_token_ids, self.sampling_params())]
        return [EngineRequest(self.index, i, ids, None) for i, ids in enumerate(spec.inputs)]

    def sampling_params(self) -> SamplingParams:
        return sampling_params_of(self.params)

    def to_job_request(self) -> JobRequest:
        """The request as kvbatch.jobs.openai_format.responses.success_line wants it (messages and prompt dropped)."""
        return job_request_of(self.to_dict())


def new_job_id() -> str:
    """A fresh job id: job-YYYYmmdd-HHMMSS-<8 hex> (UTC)."""
    return f"job-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def job_dir(output_prefix: str, job_id: str) -> Storage:
    """`<output_prefix>/<job_id>/`, after checking that the job id is one safe key part (a
    user types it: `kvbatch status ../x` must not reach outside the prefix)."""
    try:
        validate_key_part(job_id)
    except ValueError:
        shown = job_id[:40] + "..." if isinstance(job_id, str) and len(job_id) > 64 else job_id
        raise ValueError(
            f"job id {shown!r} cannot name a job: a job id is one name of letters, digits and "
            ". _ = - (not '.' or '..', at most 255 characters), like the "
            "job-<UTC time>-<random> that `kvbatch submit` prints"
        ) from None
    return open_storage(output_prefix).join(job_id)


def shard_payload(requests: list[ShardRequest]) -> bytes:
    return b"".join(
        json.dumps(r.to_dict(), separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        for r in requests
    )


def write_shard(
    job: Storage, job_id: str, shard_id: str, requests: list[ShardRequest]
) -> ShardMessage:
    """Write one shard's payload (and its lines index) under `job` (the job's folder) and
    return its message."""
    validate_key_part(shard_id)
    data = shard_payload(requests)
    target = job.join("shards", f"{shard_id}.jsonl")
    target.write_bytes(data)
    index = b"".join(
        json.dumps([r.index, r.line, r.custom_id], ensure_ascii=False).encode() + b"\n"
        for r in requests
    )
    job.join("shards", f"{shard_id}.lines.jsonl").write_bytes(index)
    return ShardMessage(job_id, shard_id, target.uri, hashlib.sha256(data).hexdigest())


def read_shard_lines(job: Storage, shard_id: str) -> list[tuple[int, int, str]]:
    """A shard's requests as (index, line, custom_id), from its lines index."""
    with job.join("shards", f"{validate_key_part(shard_id)}.lines.jsonl").open_read() as f:
        return [tuple(json.loads(line)) for line in f if line.strip()]


class PayloadMismatch(ValueError):
    """A shard's payload does not match its sha256: no delivery of it can succeed."""


def manifest_mismatch(manifest: dict, msg: ShardMessage) -> str | None:
    """Why `msg` is not a message of the job `manifest` (job.json) describes, or None: a
    tampered or stale message names a shard the job lacks, or another uri or sha256."""
    if manifest.get("job_id") not in (None, msg.job_id):
        return f"job id {msg.job_id} is not the job's ({manifest.get('job_id')})"
    entry = next((s for s in manifest.get("shards", []) if s["shard_id"] == msg.shard_id), None)
    if entry is None:
        return f"the job has no shard {msg.shard_id}"
    if entry.get("sha256") != msg.sha256:
        return (
            f"sha256 {msg.sha256[:12]}... is not the manifest's {entry.get('sha256', '')[:12]}..."
        )
    if entry.get("uri") not in (None, msg.uri):
        return f"uri {msg.uri} is not the manifest's {entry.get('uri')}"
    return None


def read_shard(msg: ShardMessage, *, verify: bool = True) -> list[ShardRequest]:
    """The requests of a shard, in the order to run them. Raises PayloadMismatch when the
    payload does not match the message's sha256 (tampered, truncated or overwritten)."""
    with open_storage(msg.uri).open_read() as f:
        data = f.read()
    if verify:
        got = hashlib.sha256(data).hexdigest()
        if got != msg.sha256:
            raise PayloadMismatch(
                f"shard payload {msg.uri} does not match its sha256 (expected {msg.sha256}, "
                f"got {got}): the payload changed after submit; resubmit the job"
            )
    return [ShardRequest.from_dict(json.loads(line)) for line in data.splitlines() if line]


def run_shard(
    llm,
    msg: ShardMessage,
    *,
    model_name: str,
    batch_id: str,
    created: int | None = None,
    window: int = 0,
    should_stop: Callable[[], bool] | None = None,
    on_output: Callable[[object], None] | None = None,
) -> list[tuple[int, dict]]:
    """Run one shard on `llm` (an engine.LLM): [(index, output or error line)] in the order
    requests finished. `model_name`, `batch_id`, `created` come from the job's manifest
    (job.json: model_name, batch_id, created_at) so that every worker writes the same ids.

    `should_stop` (the job's cancel check) is asked between engine steps; once it is True the
    shard's requests in the engine are aborted, and every request without an answer gets a
    batch_cancelled error line: the result still holds one line per request.

    `on_output` (the worker's latency metrics) sees every engine output of this shard."""
    requests = read_shard(msg)
    by_index = {r.index: r for r in requests}
    context = LineContext(model_name, batch_id, int(time.time()) if created is None else created)
    feed = (item for r in requests for item in r.engine_requests())
    results: list[tuple[int, dict]] = []
    for done in answer(
        llm.engine, feed, _job_requests(by_index), context, window=window, should_stop=should_stop
    ):
        if on_output is not None:
            on_output(done.output)
        if done.line is not None:
            results.append((done.key, done.line))
    if len(results) < len(requests):  # stopped: the rest were cancelled
        answered = {i for i, _ in results}
        results.extend(
            (r.index, cancelled_line(r.line, r.custom_id, batch_id=batch_id))
            for r in requests
            if r.index not in answered
        )
    return results


def _job_requests(by_index: dict[int, ShardRequest]) -> Callable[[int], JobRequest | None]:
    """The answer loop's view of a shard's lines: each JobRequest built once, when asked."""
    cache: dict[int, JobRequest] = {}

    def request_of(index: int) -> JobRequest | None:
        if index not in cache:
            r = by_index.get(index)
            if r is None:
                return None
            cache[index] = r.to_job_request()
        return cache[index]

    return request_of

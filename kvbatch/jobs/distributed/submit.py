"""`kvbatch submit`, the storage half: turn an input file into a distributed job's folder.

    <output>/<job_id>/job.json                  manifest: shards, counts, batch id, max_attempts,
                                                the longest request (the workers' context)
    <output>/<job_id>/batch.json                status "in_progress"
    <output>/<job_id>/validation_errors.jsonl   error lines of bad input lines, by line
    <output>/<job_id>/shards/<shard_id>.jsonl   payloads (kvbatch.jobs.distributed.shards.ShardRequest lines)

Validation and tokenization are those of `kvbatch run` (kvbatch.jobs.local.run), with the model's tokenizer
and context length read without loading weights (kvbatch.jobs.model_info). Requests are ordered by
prefix (kvbatch.jobs.grouping) and cut into shards only where a top-level prefix group starts, so no
shared prefix is computed by two workers; each shard holds about `shard_tokens` prompt tokens
(a bigger group is a shard of its own). prepare_job enqueues nothing: the caller sends
`SubmittedJob.messages`.

A job of a million lines fits: the input is streamed once to validate and tokenize (by a
pool of processes on a long job; token ids and each line's shard record spilled to disk, a row
of integers kept a line, kvbatch.jobs.distributed.job_lines), the cuts come from the trie's
walk, and each shard's records are read back by offset when it is written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path

from kvbatch.engine import block_hashes
from kvbatch.jobs import model_info
from kvbatch.jobs.distributed.job_lines import InputScan, LineTable, read_unit
from kvbatch.jobs.distributed.shards import (
    ShardMessage,
    ShardRequest,
    job_dir,
    new_job_id,
    write_shard,
)
from kvbatch.jobs.grouping import group_by_prefix
from kvbatch.jobs.local.model_on_demand import GivenModel
from kvbatch.jobs.local.prepare import JobTraits
from kvbatch.jobs.local.run import JobError, RunOptions
from kvbatch.jobs.local.scan_progress import ScanProgress
from kvbatch.jobs.local.token_store import TokenStore
from kvbatch.jobs.model_fingerprint import FingerprintError, fingerprint
from kvbatch.jobs.openai_format.batch_record import BatchRecord
from kvbatch.jobs.storage import LocalStorage, StorageError, absolute_location, open_storage

DEFAULT_MAX_ATTEMPTS = 3


@dataclass
class SubmittedJob:
    job_id: str
    dir_uri: str
    messages: list[ShardMessage]
    num_requests: int
    num_invalid: int
    output: str = ""  # the output prefix as the workers get it (a local path made absolute)


def batch_id_for(job_id: str) -> str:
    return "batch_" + hashlib.sha256(job_id.encode()).hexdigest()[:24]


def cut_shards(
    lengths: list[int], shared_blocks: list[int], shard_tokens: int
) -> list[tuple[int, int]]:
    """[start, end) ranges of positions (requests in prefix order), each about `shard_tokens`
    prompt tokens, cut where neighbours share the least.

    `shared_blocks[i]` is how many leading blocks request i shares with request i - 1. When a
    shard would overflow, it is cut at the position in it with the smallest `shared_blocks`
    (the latest such position, so shards stay full): a top-level prefix group boundary (0
    blocks shared) when there is one, else one level deeper inside a big group. A chat job
    whose prompts all share the template header and system prompt is one top-level group,
    and is still cut into shards, each between sub-groups (e.g. documents).
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    shards: list[tuple[int, int]] = []
    begin, tokens = 0, 0
    for i, n in enumerate(lengths):
        while i > begin and tokens + n > shard_tokens:  # a cut far back may still overflow
            cut = min(range(begin + 1, i + 1), key=lambda j: (shared_blocks[j], -j))
            shards.append((begin, cut))
            begin, tokens = cut, sum(lengths[cut:i])
        tokens += n
    if len(lengths) > begin:
        shards.append((begin, len(lengths)))
    return shards


def shared_leading_blocks(prompts: list[list[int]], block_size: int) -> list[int]:
    """For each prompt, the number of leading full blocks it shares with the one before."""
    shared, previous = [], []
    for ids in prompts:
        hashes = block_hashes(ids, block_size)
        n = 0
        while n < min(len(hashes), len(previous)) and hashes[n] == previous[n]:
            n += 1
        shared.append(n)
        previous = hashes
    return shared


def prepare_job(
    input_uri: str,
    output_prefix: str,
    model: str,
    *,
    model_name: str | None = None,
    shard_tokens: int = 200_000,
    block_size: int = 16,
    max_model_len: int | None = None,
    job_id: str | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    progress: ScanProgress | None = None,
) -> SubmittedJob:
    """Validate, tokenize, group and shard `input_uri` into `<output_prefix>/<job_id>/`.
    Raises JobError (before any work) when the input is unreadable, the output unwritable,
    the job id unsafe or already used, or the model's tokenizer cannot be read.
    `tool_call_parser` (kvbatch.jobs.openai_format.tool_parsers) goes into every shard request that needs it,
    so the workers read answers for tool calls without a flag of their own. `progress`
    (ScanProgress) shows the tokenizing pass on stderr.

    Memory does not grow with the lines' text: see kvbatch.jobs.distributed.job_lines. A
    failure while writing the shards (a full disk, S3 refusing) raises JobError before any
    shard is sent; the same call with the same `job_id` then completes the job."""
    job_id = new_job_id() if job_id is None else job_id
    # Workers run in other folders (and on other machines): a relative path would name
    # another folder there.
    output_prefix, input_uri = absolute_location(output_prefix), absolute_location(input_uri)
    job, source = _open_job_folder(input_uri, output_prefix, job_id)
    tokenizer, max_len = _read_model(model, max_model_len)
    batch_id = batch_id_for(job_id)
    record = BatchRecord.start(
        batch_id=batch_id,
        input_uri=input_uri,
        output_uri=job.join("output.jsonl").uri,
        errors_uri=job.join("errors.jsonl").uri,
        model=model,
    )
    opts = RunOptions(
        input=input_uri,
        model=model,
        model_name=model_name,
        tool_call_parser=tool_call_parser,
        # the prompts' renderer (kvbatch.engine.reasoning): the workers' engines choose alike
        engine={"reasoning_parser": reasoning_parser} if reasoning_parser else {},
    )
    sharded = _write_shards(source, opts, tokenizer, max_len, job, job_id, batch_id,
                            block_size, shard_tokens, progress)  # fmt: skip
    traits = sharded.traits
    record.mark_in_progress()
    record.total = sharded.num_units + sharded.num_invalid
    record.endpoint = traits.endpoint.endpoint
    manifest = {
        "job_id": job_id,
        "batch_id": batch_id,
        "input": input_uri,
        "model": model,
        "model_name": traits.job_name(),
        "created_at": record.created_at,
        "block_size": block_size,
        "max_model_len": max_len,
        # every worker without --max-model-len runs the job at this context
        # (kvbatch.jobs.job_context), whichever shards it takes
        "longest_request": traits.longest,
        "urls": sorted(traits.urls),
        "endpoint": traits.endpoint.endpoint,
        "shards": sharded.entries,
        "num_requests": sharded.num_units,
        "num_invalid": sharded.num_invalid,
        "prompt_tokens": sharded.prompt_tokens,
        "ideal_cached_tokens": sharded.ideal_cached_tokens,
        "max_attempts": max_attempts,
        "tool_call_parser": tool_call_parser,
        "reasoning_parser": reasoning_parser,
        "model_fingerprint": _fingerprint(model),
    }
    _publish(job, job_id, record, manifest)
    return SubmittedJob(job_id, job.uri, sharded.messages, sharded.num_units, sharded.num_invalid,
                        output=output_prefix)  # fmt: skip


def _open_job_folder(input_uri: str, output_prefix: str, job_id: str):
    """The job's folder and the input, both checked before any work."""
    try:
        job = job_dir(output_prefix, job_id)
    except ValueError as e:
        raise JobError(str(e)) from e
    except StorageError as e:
        raise JobError(str(e)) from e
    manifest_target = job.join("job.json")
    try:
        source = open_storage(input_uri)
        source.check_readable()
        manifest_target.check_writable()
        if manifest_target.exists():
            raise JobError(f"job {job_id} already exists at {job.uri}: pick another job id")
    except StorageError as e:
        raise JobError(str(e)) from e
    return job, source


def _read_model(model: str, max_model_len: int | None):
    """The tokenizer and context length, read without loading the weights."""
    try:
        tokenizer = model_info.load_tokenizer(model)
        return tokenizer, model_info.max_model_len(model, max_model_len, tokenizer)
    except (OSError, ValueError) as e:
        raise JobError(f"cannot read the model's tokenizer or config: {e}") from e


def _fingerprint(model: str) -> dict:
    """The model's fingerprint (kvbatch.jobs.model_fingerprint): a worker with another
    checkpoint leaves the job's shards to one that has this one."""
    try:
        return fingerprint(model).to_dict()
    except (OSError, FingerprintError) as e:
        raise JobError(f"cannot fingerprint the model {model}: {e}") from e


@dataclass
class _Sharded:
    """What validating and sharding the input wrote."""

    traits: JobTraits
    num_units: int  # answered lines (an embeddings line's inputs are one unit)
    num_invalid: int
    messages: list[ShardMessage]
    entries: list[dict]  # job.json's "shards"
    prompt_tokens: int
    ideal_cached_tokens: int


def _write_shards(
    source, opts: RunOptions, tokenizer, max_len: int, job, job_id: str, batch_id: str,
    block_size: int, shard_tokens: int, progress: ScanProgress | None,
) -> _Sharded:  # fmt: skip
    """Validate and tokenize (as `kvbatch run` does) in one streaming pass, write the
    validation errors, order by prefix and write one payload per shard, reading each line's
    record back from the pass's spill (kvbatch.jobs.distributed.job_lines)."""
    spill = Path(tempfile.mkdtemp(prefix="kvbatch-submit-"))
    try:
        if progress is not None and isinstance(source, LocalStorage):
            progress.total = source.path.stat().st_size
        with TokenStore(spill) as store:
            scan = InputScan(source, opts, GivenModel(tokenizer, max_len), store, spill,
                             batch_id, progress)  # fmt: skip
            order = group_by_prefix(scan.prompts(), block_size)
            scanned = scan.result
            table = scanned.table
            _write_errors(job, job_id, scanned.errors_path)
            lengths = array("q", (table.tokens[u] for u in order.order))
            messages, entries = [], []
            with open(scan.records_path, "rb") as f:
                cuts = cut_shards(lengths, order.shared_blocks, shard_tokens)
                for n, (a, b) in enumerate(cuts):
                    shard_id = f"shard-{n:05d}"
                    reqs = [_shard_request(u, f, table, store) for u in order.order[a:b]]
                    msg = _write_shard(job, job_id, shard_id, reqs, n, len(cuts))
                    messages.append(msg)
                    entries.append(
                        {
                            "shard_id": shard_id,
                            "uri": msg.uri,
                            "sha256": msg.sha256,
                            "num_requests": b - a,
                            "prompt_tokens": sum(lengths[a:b]),
                        }
                    )
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    return _Sharded(
        scanned.traits,
        len(table),
        scanned.num_errors,
        messages,
        entries,
        order.prompt_tokens,
        order.ideal_cached_tokens,
    )


def _write_errors(job, job_id: str, path: Path) -> None:
    """validation_errors.jsonl, streamed from the spill file (already in line order)."""
    try:
        with open(path, "rb") as src, job.join("validation_errors.jsonl").open_write() as out:
            shutil.copyfileobj(src, out, 1 << 20)
    except (StorageError, OSError) as e:
        raise JobError(
            _unfinished(job_id, job, f"writing validation_errors.jsonl failed: {e}")
        ) from e


def _write_shard(job, job_id: str, shard_id: str, reqs, n: int, total: int) -> ShardMessage:
    """One shard's payload; a failed write (a full disk, S3 refusing) names how to finish the
    job: nothing was sent yet, so the same job id submitted again completes it."""
    try:
        return write_shard(job, job_id, shard_id, reqs)
    except (StorageError, OSError) as e:
        raise JobError(
            _unfinished(job_id, job, f"writing shard {n + 1} of {total} ({shard_id}) failed: {e}")
        ) from e


def _unfinished(job_id: str, job, why: str) -> str:
    return (
        f"job {job_id} at {job.uri} is not submitted: {why}. No shard was sent; once the "
        f"cause is fixed, run the same `kvbatch submit` with --job-id {job_id} to complete it"
    )


def _publish(job, job_id: str, record: BatchRecord, manifest: dict) -> None:
    """batch.json, then the manifest last: a job folder with job.json is complete (shards and
    batch.json there)."""
    job.join("batch.json").write_bytes(json.dumps(record.to_dict(), indent=2).encode() + b"\n")
    if not job.join("job.json").write_if_absent(json.dumps(manifest, indent=2).encode() + b"\n"):
        raise JobError(f"job {job_id} was created concurrently at {job.uri}")


def _shard_request(unit: int, f, table: LineTable, store: TokenStore) -> ShardRequest:
    """Answered line `unit` as a shard request: its record read back from the spill `f`, its
    tokens from the store."""
    entry = table.entry[unit]
    end = table.entry[unit + 1] if unit + 1 < len(table) else len(store)
    return ShardRequest(**read_unit(f, table, unit, [store[i] for i in range(entry, end)]))

"""The model stages as ordinary kvbatch jobs: OpenAI batch lines written into the run's folder,
run by `kvbatch run`'s run_job with --resume, answers read back by custom_id. So a stage
resumes after a kill (run_job's partial output) and answers each line once, and a stage that
finished in an earlier attempt of the same run is read back, not run again. The run folder is
a Storage: a local folder or an s3:// prefix, read and written the same way."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from kvbatch.jobs.local.run import RunOptions, run_job
from kvbatch.jobs.storage import Storage, StorageError

log = logging.getLogger("kvbatch.index")


@dataclass
class StageAnswers:
    """What a stage's job gave: per custom_id an answer body or an error, and its usage."""

    bodies: dict[str, dict] = field(default_factory=dict)
    errors: dict[str, dict] = field(default_factory=dict)  # custom_id -> {"code", "message"}
    prompt_tokens: int = 0
    cached_tokens: int = 0


def chat_line(custom_id: str, model: str, prompt: str, max_tokens: int) -> dict:
    """A greedy chat line: the same answer on every run (and every resume)."""
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def embedding_line(custom_id: str, model: str, text: str) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": model, "input": text},
    }


def write_lines(target: Storage, lines: Iterable[dict]) -> int:
    """Write the job's input (again: it is the same for the same run) and count its lines."""
    n = 0
    with target.open_write() as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n")
            n += 1
    return n


def stage_finished(folder: Storage) -> bool:
    """The stage's job completed in an earlier attempt of this run (batch.json says so)."""
    try:
        with folder.join("output.batch.json").open_read() as f:
            return json.loads(f.read()).get("status") == "completed"
    except (OSError, ValueError, StorageError):
        return False


def run_stage(folder: Storage, model: str, llm, engine: dict) -> StageAnswers:
    """Run (or resume) the job whose input is folder/input.jsonl, then read its answers."""
    if not stage_finished(folder):
        opts = RunOptions(
            input=folder.join("input.jsonl").uri,
            model=model,
            output=folder.join("output.jsonl").uri,
            resume=True,
            engine=dict(engine),
        )
        run_job(opts, llm=llm)
    return read_answers(folder)


def read_answers(folder: Storage, errors: str = "output.errors.jsonl") -> StageAnswers:
    """The answers in folder/output.jsonl and the error lines in folder/`errors` (a
    distributed job's folder names them errors.jsonl). An embeddings answer's vectors are kept
    as float32 arrays (as the engine made them and the table stores them): as JSON's Python
    floats a 384-dimensional vector takes some 12 KB, as an array 1.6."""
    answers = StageAnswers()
    for line in _jsonl(folder.join("output.jsonl")):
        body = line["response"]["body"]
        for item in body.get("data") or ():
            if isinstance(item, dict) and isinstance(item.get("embedding"), list):
                item["embedding"] = np.asarray(item["embedding"], dtype=np.float32)
        answers.bodies[line["custom_id"]] = body
        usage = body.get("usage") or {}
        answers.prompt_tokens += usage.get("prompt_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        answers.cached_tokens += details.get("cached_tokens", 0) or 0
    for line in _jsonl(folder.join(errors)):
        answers.errors[line["custom_id"]] = line["error"]
    return answers


def _jsonl(file: Storage) -> Iterator[dict]:
    if not file.exists():
        return
    with file.open_read() as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def chat_text(body: dict) -> str:
    return (body["choices"][0]["message"].get("content") or "").strip()


def embedding_vector(body: dict) -> np.ndarray:
    return body["data"][0]["embedding"]

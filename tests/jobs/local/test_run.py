"""`kvbatch run` end to end, in process: kvbatch.jobs.local.run.run_job on a tiny random Llama that has
SmolLM2's real tokenizer and chat template (the `tiny_chat_model` fixture), one engine shared
by the module. Subprocess checks (SIGKILL and --resume, exit codes) are in test_run_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import BaseModel as OpenAIModel
from openai.types import Batch, Completion
from openai.types.chat import ChatCompletion

from kvbatch.jobs.local.partial import PartialOutput
from kvbatch.jobs.local.run import RunOptions, job_identity, line_digest, resolve_paths, run_job
from tests.s3_server import S3Server

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MODEL_NAME = "tiny-chat"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def llm(tiny_chat_model: Path):
    from kvbatch.engine import LLM

    return LLM(
        model=str(tiny_chat_model),
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=64,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=64 * MiB,
    )


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Partial outputs of S3 jobs go under $KVBATCH_CACHE: keep them out of ~/.cache."""
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "cache"))


# -- helpers -------------------------------------------------------------------------------------


def chat(custom_id: str, content: str, **body) -> dict:
    body = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0, **body}
    body.setdefault("messages", [{"role": "user", "content": content}])
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def completion(custom_id: str, prompt, **body) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, **body}
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}


def write_jsonl(path: Path, lines: list[dict | str | bytes]) -> Path:
    """Dicts become JSON lines; str and bytes lines are written as they are (malformed ones)."""
    raw = []
    for line in lines:
        if isinstance(line, dict):
            line = json.dumps(line)
        raw.append(line if isinstance(line, bytes) else line.encode())
    path.write_bytes(b"\n".join(raw) + b"\n")
    return path


def plant_partial(opts: RunOptions, lines: list, answers: list[dict], tail: bytes = b"") -> Path:
    """The partial output an interrupted run of `opts` leaves: `answers` committed (each the
    answer to the input line of its custom_id in `lines`), then `tail` (a line torn by a kill)."""
    raw = {d["custom_id"]: json.dumps(d).encode() for d in lines if isinstance(d, dict)}
    path = resolve_paths(opts).partial
    partial = PartialOutput(path)
    partial.reset(job_identity(opts))
    for answer in answers:
        partial.add(answer, line_digest(raw[answer["custom_id"]]))
    partial.close()
    with open(path, "ab") as f:
        f.write(tail)
    return path


def read_jsonl(data: bytes | Path) -> list[dict]:
    if isinstance(data, Path):
        data = data.read_bytes()
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def no_extra_fields(model: OpenAIModel, where: str = "body") -> None:
    """openai's models accept unknown fields (extra="allow"): a typo'd key would pass
    model_validate, so walk the tree and fail on any field the SDK does not know."""
    assert not model.model_extra, f"{where}: fields unknown to openai: {sorted(model.model_extra)}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        children = value if isinstance(value, list) else [value]
        for i, child in enumerate(children):
            if isinstance(child, OpenAIModel):
                no_extra_fields(child, f"{where}.{name}[{i}]")


def check_openai_line(line: dict, url: str) -> ChatCompletion | Completion:
    """One success line: OpenAI's batch output envelope around a body that parses as the
    openai SDK's own type for `url`, with consistent usage."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["error"] is None and line["id"].startswith("batch_req_")
    assert line["response"]["status_code"] == 200
    assert line["response"]["request_id"].startswith("req_")
    kind = ChatCompletion if url == CHAT else Completion
    body = kind.model_validate(line["response"]["body"], strict=True)
    no_extra_fields(body)
    assert body.model == MODEL_NAME and len(body.choices) == 1
    usage = body.usage
    assert usage is not None and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert body.choices[0].finish_reason in ("stop", "length")
    return body


def url_of(line: dict) -> str:
    """The url an output line answers, from its body's object type."""
    return COMPLETIONS if line["response"]["body"]["object"] == "text_completion" else CHAT


def answer_text(line: dict) -> str:
    choice = line["response"]["body"]["choices"][0]
    return choice["text"] if url_of(line) == COMPLETIONS else choice["message"]["content"]


def batch_json(record_uri: str) -> dict:
    """batch.json, checked to be an `openai.types.Batch` (every job shape must be one)."""
    record = json.loads(Path(record_uri).read_text())
    Batch.model_validate(record)
    return record


def usage_sums(lines: list[dict]) -> tuple[int, int, int]:
    usages = [line["response"]["body"]["usage"] for line in lines]
    return (
        sum(u["prompt_tokens"] for u in usages),
        sum(u["completion_tokens"] for u in usages),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages),
    )


def check_counts_and_usage(batch: dict, answered: list[dict], failed: list[dict]) -> None:
    counts = batch["request_counts"]
    assert counts == {
        "total": len(answered) + len(failed),
        "completed": len(answered),
        "failed": len(failed),
    }
    prompt, output, cached = usage_sums(answered)
    usage = batch["usage"]
    assert usage["input_tokens"] == prompt
    assert usage["output_tokens"] == output
    assert usage["input_tokens_details"]["cached_tokens"] == cached
    assert usage["total_tokens"] == prompt + output


# -- answers in OpenAI's types -------------------------------------------------------------------


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


@pytest.mark.parametrize("url", [CHAT, COMPLETIONS])
def test_output_parses_as_openai_types(llm, tmp_path: Path, url: str):
    make = chat if url == CHAT else completion
    extra = (
        {"logprobs": True, "top_logprobs": 2} if url == CHAT else {"logprobs": 2}
    )  # logprobs exercise the SDK's nested token types
    lines = [make(f"q{i}", " ".join(WORDS[i:] + WORDS[:i])) for i in range(6)]
    lines.append(make("with-logprobs", "say something", **extra))
    lines.append(make("with-stop", "say something else", stop=["\n", "."], max_tokens=12))
    if url == COMPLETIONS:
        lines.append(completion("token-ids", [1, 200, 300, 400]))
    else:
        lines.append(
            chat(
                "system-and-parts",
                "",
                messages=[
                    {"role": "developer", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                ],
            )
        )
    opts = RunOptions(input=str(write_jsonl(tmp_path / "in.jsonl", lines)), model="unused")
    record = run_job(opts, llm=llm)

    paths = resolve_paths(opts)
    assert paths.output == str(tmp_path / "in.output.jsonl")
    out = read_jsonl(Path(paths.output))
    assert [line["custom_id"] for line in out] == [line["custom_id"] for line in lines]
    bodies = [check_openai_line(line, url) for line in out]
    assert len({line["id"] for line in out}) == len(out)
    for body in bodies:
        assert body.usage.completion_tokens <= 12
    logprobs = bodies[len(lines) - 3].choices[0].logprobs
    assert logprobs is not None
    if url == CHAT:
        assert bodies[0].object == "chat.completion"
        steps = logprobs.content
        assert len(steps) == bodies[-3].usage.completion_tokens
        assert all(len(step.top_logprobs) == 2 and step.bytes for step in steps)
        assert "".join(step.token for step in steps) == bodies[-3].choices[0].message.content
    else:
        assert bodies[0].object == "text_completion"
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset)
        assert "".join(logprobs.tokens) == bodies[-3].choices[0].text

    assert Path(paths.errors).read_bytes() == b""
    batch = batch_json(paths.batch)
    Batch.model_validate(batch)  # batch.json is OpenAI's batch object
    assert batch["endpoint"] == url and batch["status"] == "completed"
    assert batch["id"] == record.id and batch["output_file_id"] == paths.output
    check_counts_and_usage(batch, out, [])
    assert not paths.partial.exists()  # the resumable partial output is cleaned up


def test_mixed_urls_in_one_job(llm, tmp_path: Path):
    lines = [chat("c1", "hello"), completion("p1", "once upon a time"), chat("c2", "bye")]
    opts = RunOptions(
        input=str(write_jsonl(tmp_path / "in.jsonl", lines)),
        model="unused",
        output=str(tmp_path / "answers" / "out.jsonl"),
    )
    run_job(opts, llm=llm)
    out = read_jsonl(tmp_path / "answers" / "out.jsonl")
    assert [line["custom_id"] for line in out] == ["c1", "p1", "c2"]
    for line, url in zip(out, [CHAT, COMPLETIONS, CHAT]):
        check_openai_line(line, url)
    batch = batch_json(str(tmp_path / "answers" / "out.batch.json"))
    assert batch["endpoint"] == CHAT  # the first line's: openai's Batch names one
    check_counts_and_usage(batch, out, [])


# -- malformed lines -----------------------------------------------------------------------------

LONG_PROMPT = " ".join(["word"] * (MAX_MODEL_LEN + 50))


def _malformed_job() -> tuple[list, dict[int, tuple[str | None, str]]]:
    """Input lines (good and bad, with blanks), and per bad line number (custom_id, code)."""
    good = lambda i: (chat if i % 2 else completion)(f"good-{i}", f"question {i}")  # noqa: E731
    bad: list[tuple[object, str | None, str]] = [
        ("{not json", None, "invalid_json"),
        ('{"custom_id": "nan", "body": NaN}', None, "invalid_json"),
        ("[1, 2, 3]", None, "not_an_object"),
        (b'{"custom_id": "latin-1 \xe9"}', None, "invalid_encoding"),
        ({k: v for k, v in chat("x", "hi").items() if k != "custom_id"}, None, "missing_custom_id"),
        ({**chat("x", "hi"), "custom_id": 17}, None, "invalid_custom_id"),
        (chat("good-0", "same id again"), "good-0", "duplicate_custom_id"),
        ({**chat("bad-method", "hi"), "method": "GET"}, "bad-method", "invalid_method"),
        ({**chat("bad-url", "hi"), "url": "/v1/moderations"}, "bad-url", "invalid_url"),
        ({**chat("bad-body", "hi"), "body": "hi"}, "bad-body", "invalid_body"),
        (chat("other-model", "hi", model="gpt-4o"), "other-model", "model_mismatch"),
        (
            {**chat("no-messages", "hi"), "body": {"model": MODEL_NAME, "max_tokens": 3}},
            "no-messages",
            "missing_messages",
        ),
        (
            {**completion("no-prompt", "x"), "body": {"model": MODEL_NAME, "max_tokens": 3}},
            "no-prompt",
            "missing_prompt",
        ),
        (chat("hot", "hi", temperature="hot"), "hot", "invalid_parameter"),
        (completion("top-p", "hi", top_p=1.5), "top-p", "invalid_parameter"),
        (chat("n-big", "hi", n=200), "n-big", "invalid_parameter"),
        (
            {**chat("embed-here", "hi"), "url": "/v1/embeddings", "body": {"input": "x"}},
            "embed-here",
            "invalid_url",
        ),
        (
            chat("tools", "hi", tools=[{"type": "function", "function": {"name": "f"}}]),
            "tools",
            "unsupported_parameter",
        ),
        (chat("stream", "hi", stream=True), "stream", "unsupported_parameter"),
        (chat("typo", "hi", temprature=0.5), "typo", "unknown_parameter"),
        (chat("no-turns", "", messages=[]), "no-turns", "invalid_messages"),
        (
            chat("robot", "", messages=[{"role": "robot", "content": "beep"}]),
            "robot",
            "invalid_messages",
        ),
        (completion("too-long", LONG_PROMPT), "too-long", "context_length_exceeded"),
        (chat("too-long-chat", LONG_PROMPT), "too-long-chat", "context_length_exceeded"),
        (
            chat("cap-too-big", "hi", max_tokens=MAX_MODEL_LEN),
            "cap-too-big",
            "context_length_exceeded",
        ),
        (completion("bad-token", [1, 10**6]), "bad-token", "invalid_prompt"),
    ]
    lines: list = []
    expected: dict[int, tuple[str | None, str]] = {}
    for i, (line, custom_id, code) in enumerate(bad):
        lines.append(good(i))
        if i % 5 == 4:
            lines.append("   ")  # blank lines count for line numbers, not as requests
        lines.append(line)
        expected[len(lines)] = (custom_id or f"kvbatch-line-{len(lines)}", code)
    lines.append(good(len(bad)))
    lines.append("")
    return lines, expected


def test_malformed_lines_get_error_records(llm, tmp_path: Path):
    lines, expected = _malformed_job()
    assert len(set(code for _, code in expected.values())) >= 15
    opts = RunOptions(input=str(write_jsonl(tmp_path / "job.jsonl", lines)), model="unused")
    run_job(opts, llm=llm)
    paths = resolve_paths(opts)

    errors = read_jsonl(Path(paths.errors))
    got = {e["error"]["line"]: (e["custom_id"], e["error"]["code"]) for e in errors}
    assert got == expected
    assert [e["error"]["line"] for e in errors] == sorted(expected)  # by line number
    for e in errors:
        assert e["response"] is None and e["id"].startswith("batch_req_")
        assert e["error"]["message"].startswith(f"line {e['error']['line']}: ")
    assert len({e["id"] for e in errors}) == len(errors)

    out = read_jsonl(Path(paths.output))
    good_ids = [
        line["custom_id"]
        for n, line in enumerate(lines, 1)
        if isinstance(line, dict) and n not in expected
    ]
    assert [line["custom_id"] for line in out] == good_ids  # every good line, in input order
    for line in out:
        check_openai_line(line, url_of(line))

    batch = batch_json(paths.batch)
    non_blank = sum(1 for line in lines if (line if isinstance(line, bytes) else str(line)).strip())
    assert batch["request_counts"]["total"] == non_blank == len(out) + len(errors)
    check_counts_and_usage(batch, out, errors)


def test_model_name_option_overrides_the_first_line(llm, tmp_path: Path):
    lines = [chat("a", "hi", model="first"), chat("b", "hi", model="job"), chat("c", "hi")]
    del lines[2]["body"]["model"]  # a line naming no model takes the job's
    opts = RunOptions(
        input=str(write_jsonl(tmp_path / "in.jsonl", lines)), model="unused", model_name="job"
    )
    run_job(opts, llm=llm)
    paths = resolve_paths(opts)
    errors = read_jsonl(Path(paths.errors))
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == [
        ("a", "model_mismatch", 1)
    ]
    out = read_jsonl(Path(paths.output))
    assert [line["custom_id"] for line in out] == ["b", "c"]
    assert {line["response"]["body"]["model"] for line in out} == {"job"}


# -- S3 in and out -------------------------------------------------------------------------------


@pytest.mark.slow
def test_s3_in_and_out_with_multipart_output(
    llm, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from kvbatch.jobs.storage.s3 import MIN_PART_SIZE

    monkeypatch.setenv("KVBATCH_S3_PART_SIZE", str(MIN_PART_SIZE))
    bucket = s3_server.make_bucket()
    s3 = s3_server.client()
    # Output lines are ~1.2 kB with 500-character custom_ids: 4,600 of them are > 5 MiB.
    n = 4600
    lines: list = [
        completion(f"{i:05d}-" + "x" * 494, [1 + i % 300, 7, 11], max_tokens=1) for i in range(n)
    ]
    lines[10] = "not json"
    lines[20] = chat("streams", "hi", stream=True)
    body = b"\n".join(json.dumps(x).encode() if isinstance(x, dict) else x.encode() for x in lines)
    s3.put_object(Bucket=bucket, Key="jobs/in.jsonl", Body=body + b"\n")

    output = f"s3://{bucket}/results/out.jsonl"
    opts = RunOptions(
        input=f"s3://{bucket}/jobs/in.jsonl", model="unused", output=output, window=512
    )
    paths = resolve_paths(opts)
    assert paths.errors == f"s3://{bucket}/results/out.errors.jsonl"
    assert paths.batch == f"s3://{bucket}/results/out.batch.json"
    assert paths.partial.is_relative_to(tmp_path / "cache")
    run_job(opts, llm=llm)

    head = s3.head_object(Bucket=bucket, Key="results/out.jsonl")
    assert head["ContentLength"] > MIN_PART_SIZE
    etag = head["ETag"].strip('"')
    assert "-" in etag and int(etag.rsplit("-", 1)[1]) >= 2, etag  # a multipart upload

    def get(key: str) -> bytes:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    out = read_jsonl(get("results/out.jsonl"))
    want = [x["custom_id"] for x in lines if isinstance(x, dict) and x["custom_id"] != "streams"]
    assert [line["custom_id"] for line in out] == want
    check_openai_line(out[0], COMPLETIONS)
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 1 for line in out)
    errors = read_jsonl(get("results/out.errors.jsonl"))
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == [
        (11, "invalid_json"),
        (21, "unsupported_parameter"),
    ]
    batch = json.loads(get("results/out.batch.json"))
    assert batch["output_file_id"] == output and batch["input_file_id"] == opts.input
    check_counts_and_usage(batch, out, errors)
    assert batch["request_counts"]["total"] == n
    assert not paths.partial.exists()
    # Nothing else was left in the bucket: no write probes, no unfinished uploads.
    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == [
        "jobs/in.jsonl",
        "results/out.batch.json",
        "results/out.errors.jsonl",
        "results/out.jsonl",
    ]
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")


# -- empty input (the jobs that fail before any work: test_run_fails_early.py) --------------------


def test_empty_input_completes_with_zero_requests(llm, tmp_path: Path):
    source = tmp_path / "empty.jsonl"
    source.write_bytes(b"")
    opts = RunOptions(input=str(source), model="unused")
    record = run_job(opts, llm=llm)
    paths = resolve_paths(opts)
    # nothing could run: failed, as OpenAI fails a file without requests
    assert record.total == 0 and record.status == "failed"
    assert Path(paths.output).read_bytes() == b"" and Path(paths.errors).read_bytes() == b""
    batch = batch_json(paths.batch)
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert batch["usage"]["total_tokens"] == 0
    assert batch["completed_at"] is None and batch["failed_at"] >= batch["created_at"]
    assert [e["code"] for e in batch["errors"]["data"]] == ["empty_file"]
    assert batch["endpoint"] == CHAT


def test_a_job_of_bad_lines_only_fails_listing_them(llm, tmp_path: Path):
    lines = ["not json", chat("hot", "hi", temperature="hot"), {"custom_id": "x"}]
    opts = RunOptions(input=str(write_jsonl(tmp_path / "bad.jsonl", lines)), model="unused")
    record = run_job(opts, llm=llm)
    assert (record.status, record.total, record.failed) == ("failed", 3, 3)
    batch = batch_json(resolve_paths(opts).batch)
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [
        ("invalid_json", 1),
        ("invalid_parameter", 2),
        ("invalid_method", 3),
    ]
    assert batch["completed_at"] is None and batch["failed_at"] is not None


def test_blank_lines_only_is_an_empty_job(llm, tmp_path: Path):
    source = tmp_path / "blank.jsonl"
    source.write_bytes(b"\n  \n\t\n")
    record = run_job(RunOptions(input=str(source), model="unused"), llm=llm)
    assert (record.total, record.completed, record.failed) == (0, 0, 0)


# -- resume (in process; the SIGKILL version is in test_run_cli.py) -----------------------------


def test_resume_skips_committed_answers_and_cuts_a_torn_line(llm, tmp_path: Path):
    lines = [chat(f"r{i}", " ".join(WORDS[: 3 + i % 9]) + f" {i}") for i in range(40)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="unused", output=str(tmp_path / "out.jsonl"))
    run_job(opts, llm=llm)  # uninterrupted, to the same output (so the same ids)
    reference = read_jsonl(tmp_path / "out.jsonl")

    # An interrupted run: 10 answers committed (one of them planted, to show it is kept and
    # not recomputed), then the first half of an 11th line torn by the kill.
    opts.resume = True
    committed = [dict(line) for line in reference[5:15]]
    planted = json.loads(json.dumps(committed[3]))
    planted["response"]["body"]["choices"][0]["message"]["content"] = "PLANTED"
    committed[3] = planted
    torn = json.dumps(reference[15]).encode()
    partial = plant_partial(opts, lines, committed, torn[: len(torn) // 2])
    run_job(opts, llm=llm)

    out = read_jsonl(tmp_path / "out.jsonl")
    assert [line["custom_id"] for line in out] == [line["custom_id"] for line in lines]
    assert answer_text(out[8]) == "PLANTED"
    out[8] = reference[8]
    assert [answer_text(line) for line in out] == [answer_text(line) for line in reference]
    assert [line["id"] for line in out] == [line["id"] for line in reference]
    batch = batch_json(str(tmp_path / "out.batch.json"))
    check_counts_and_usage(batch, out, [])
    assert not partial.exists()


def test_resume_without_a_partial_file_runs_everything(llm, tmp_path: Path):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("a", "hi"), completion("b", "hello")])
    opts = RunOptions(input=str(source), model="unused", resume=True)
    assert not resolve_paths(opts).partial.exists()
    record = run_job(opts, llm=llm)
    assert (record.completed, record.failed) == (2, 0)


# -- the prefix cache shows in the answers -------------------------------------------------------


def test_rag_job_reports_cached_tokens(llm, tmp_path: Path):
    docs = [" ".join(f"{WORDS[(d * 7 + k) % len(WORDS)]}{k}" for k in range(60)) for d in range(3)]
    lines = []
    for c in range(4):  # chunks of a document are far apart in the input: grouping joins them
        for d, doc in enumerate(docs):
            lines.append(
                chat(
                    f"doc{d}-q{c}",
                    "",
                    messages=[
                        {"role": "system", "content": f"Answer from this document.\n{doc}"},
                        {"role": "user", "content": f"question {c} about part {c * 5}?"},
                    ],
                    max_tokens=3,
                )
            )
    opts = RunOptions(input=str(write_jsonl(tmp_path / "rag.jsonl", lines)), model="unused")
    run_job(opts, llm=llm)
    paths = resolve_paths(opts)
    out = read_jsonl(Path(paths.output))
    batch = batch_json(paths.batch)
    check_counts_and_usage(batch, out, [])

    assert batch["usage"]["input_tokens_details"]["cached_tokens"] > 0
    cached = [
        line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for line in out
    ]
    prompt = [line["response"]["body"]["usage"]["prompt_tokens"] for line in out]
    assert all(c % BLOCK_SIZE == 0 and c < p for c, p in zip(cached, prompt))
    # Every chunk but the first of its document reuses the document's blocks (at least 4).
    doc_blocks = 4 * BLOCK_SIZE
    assert sum(c >= doc_blocks for c in cached) >= len(docs) * 3


def test_resume_after_a_kill_while_finalizing(llm, tmp_path: Path):
    """Every answer was committed, the output not yet written: resume runs nothing and writes
    what the uninterrupted run wrote."""
    lines = [chat(f"r{i}", f"question {i}") for i in range(5)] + ["oops"]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="unused")
    run_job(opts, llm=llm)
    paths = resolve_paths(opts)
    reference = Path(paths.output).read_bytes()
    reference_batch = batch_json(paths.batch)
    Path(paths.output).unlink()
    plant_partial(opts, lines, read_jsonl(reference))  # every answer committed

    opts.resume = True
    record = run_job(opts, llm=llm)
    assert Path(paths.output).read_bytes() == reference
    batch = batch_json(paths.batch)
    assert batch["endpoint"] == reference_batch["endpoint"] == CHAT
    assert batch["request_counts"] == reference_batch["request_counts"]
    assert batch["usage"] == reference_batch["usage"]
    assert (record.completed, record.failed) == (5, 1)

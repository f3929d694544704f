"""`kvbatch run` on a reasoning model (a tiny random model that thinks in <think> blocks:
tests/think_model.py): reasoning_content apart from content, the JSON schema applied to the
answer only, max_tokens inside the reasoning, chat_template_kwargs and reasoning_effort; every
line an openai ChatCompletion with reasoning_content as vLLM writes it (an extra field)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from kvbatch.cli import main
from tests.jobs.local.test_run import chat, read_jsonl, write_jsonl
from tests.jobs.openai_format.test_conformance import check_line

END = 49153  # </think> in tests/think_model.py's tokenizer
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
CLOSE_SOON = {str(END): 2.0}  # a random model never closes its reasoning unprompted


def lines() -> list[dict]:
    ask = "Where is the Eiffel tower?"
    schema = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    return [
        chat("think", ask, max_tokens=60, logit_bias=CLOSE_SOON),
        chat("json", ask, max_tokens=60, logit_bias=CLOSE_SOON, response_format=schema),
        chat("cut", ask, max_tokens=5),
        chat("off", ask, max_tokens=8, chat_template_kwargs={"enable_thinking": False}),
        chat("effort", ask, max_tokens=5, reasoning_effort="low"),
        chat("bad", ask, reasoning_effort="extreme"),
    ]


def run(tmp_path: Path, model: Path, *flags: str) -> tuple[dict, list[dict]]:
    src = write_jsonl(tmp_path / "in.jsonl", lines())
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    argv = ["run", str(src), "-o", str(out), "--errors", str(errors), "--model", str(model),
            "--device", "cpu", "--threads", "1", "--kv-cache-bytes", "16MiB", *flags]  # fmt: skip
    assert main(argv) == 0
    answered = [check_line(raw) for raw in out.read_text().splitlines()]
    return {x["custom_id"]: x for x in answered}, read_jsonl(errors)


def message(line: dict) -> tuple[dict, str, dict]:
    body = line["response"]["body"]
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.model_extra.keys() == {"reasoning_content"}
    [choice] = body["choices"]
    return choice["message"], choice["finish_reason"], body["usage"]


@pytest.fixture(scope="module")
def answers(think_model: Path, tmp_path_factory: pytest.TempPathFactory):
    return run(tmp_path_factory.mktemp("reasoning"), think_model)


def test_reasoning_apart_from_content(answers):
    by_id, _ = answers
    msg, _, usage = message(by_id["think"])
    assert msg["reasoning_content"] and msg["content"] is not None
    # the first </think> ends the reasoning (the biased model may write more of them after)
    assert "<think>" not in msg["reasoning_content"]
    assert "</think>" not in msg["reasoning_content"]
    reasoning_tokens = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < reasoning_tokens < usage["completion_tokens"]


def test_json_schema_applies_to_the_answer_only(answers):
    by_id, _ = answers
    msg, finish, usage = message(by_id["json"])
    assert finish == "stop"
    assert json.loads(msg["content"]).keys() == {"city"}
    assert msg["reasoning_content"] and not msg["reasoning_content"].startswith("{")
    assert usage["completion_tokens_details"]["reasoning_tokens"] > 5


def test_max_tokens_inside_the_reasoning(answers):
    by_id, _ = answers
    msg, finish, usage = message(by_id["cut"])
    assert finish == "length" and msg["content"] is None and msg["reasoning_content"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == usage["completion_tokens"] == 5


def test_thinking_switched_off_by_the_template(answers):
    by_id, _ = answers
    msg, _, usage = message(by_id["off"])
    assert msg["reasoning_content"] is None and msg["content"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 0


def test_reasoning_effort_is_checked(answers):
    by_id, errors = answers
    assert "effort" in by_id
    [error] = errors
    assert error["custom_id"] == "bad" and error["error"]["code"] == "invalid_parameter"
    assert "reasoning_effort" in error["error"]["message"]


def test_parser_off_leaves_the_text_whole(think_model: Path, tmp_path: Path, answers):
    """--reasoning-parser none: no split, the markers stay in the content as the model wrote
    them (they are ordinary tokens of this tokenizer)."""
    by_id, _ = run(tmp_path, think_model, "--reasoning-parser", "none")
    [choice] = by_id["think"]["response"]["body"]["choices"]
    assert "reasoning_content" not in choice["message"]
    assert "</think>" in choice["message"]["content"]
    usage = by_id["think"]["response"]["body"]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 0
    same_tokens = answers[0]["think"]["response"]["body"]["usage"]["completion_tokens"]
    assert usage["completion_tokens"] == same_tokens


def test_workers_answer_as_kvbatch_run(think_model: Path, tmp_path: Path, answers):
    """submit (prompts rendered with the detected parser) + the workers' shard path: the
    same reasoning_content, content and usage as `kvbatch run`."""
    from kvbatch.engine import LLM
    from kvbatch.jobs.distributed.finalize import try_finalize
    from kvbatch.jobs.distributed.shards import job_dir
    from kvbatch.jobs.distributed.submit import prepare_job
    from tests.jobs.distributed.test_finalize import run_shards

    src = write_jsonl(tmp_path / "in.jsonl", lines())
    sub = prepare_job(str(src), str(tmp_path / "jobs"), str(think_model))
    job = job_dir(str(tmp_path / "jobs"), sub.job_id)
    llm = LLM(model=str(think_model), device="cpu", kv_cache_bytes=16 << 20)
    run_shards(llm, job, sub.messages)
    assert try_finalize(job) is not None
    with job.join("output.jsonl").open_read() as f:
        remote = {x["custom_id"]: x for x in map(json.loads, f.read().splitlines())}
    local, _ = answers
    assert remote.keys() == local.keys()
    for custom_id, line in remote.items():
        check_line(json.dumps(line))
        ours, theirs = (x["response"]["body"] for x in (line, local[custom_id]))
        assert ours["choices"] == theirs["choices"] and ours["usage"] == theirs["usage"]


def test_a_worker_takes_the_parser_submit_named(think_model: Path, tmp_path: Path):
    """`submit --reasoning-parser none` renders prompts for no parser and records it in
    job.json: a worker started without the flag (it would detect the think parser) loads its
    engine with the job's, and the next job that names none gets the worker's own again."""
    from kvbatch.worker.tasks import WorkerModel

    model = WorkerModel(str(think_model), {"device": "cpu", "kv_cache_bytes": 16 << 20})
    assert model.llm().engine.reasoning is not None  # detected: <think> ... </think>
    assert model.llm(0, "none").engine.reasoning is None
    assert model.llm().engine.reasoning is None  # no job: the engine as loaded
    assert model.llm(0, None).engine.reasoning is not None  # a job that named none

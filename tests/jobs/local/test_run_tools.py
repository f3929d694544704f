"""Tool calling through a real `kvbatch run` and through the workers' shard path, on the tiny
random chat model with a Qwen-style tool template: forced tool_choice answers are arguments
that validate against the tool's own JSON schema (jsonschema), and every body is an openai
ChatCompletion."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from kvbatch.cli import main
from kvbatch.jobs.distributed.finalize import try_finalize
from kvbatch.jobs.distributed.shards import job_dir
from kvbatch.jobs.distributed.submit import prepare_job
from tests.jobs.distributed.test_finalize import run_shards
from tests.jobs.local.test_run import BLOCK_SIZE, MiB, chat, read_jsonl, write_jsonl
from tests.jobs.openai_format.test_conformance import run
from tests.jobs.qwen_tool_template import with_tool_template

CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MAX_LEN = 1024  # the tool prompts (the Qwen template lists every tool) need more than 256
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def tool_llm(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory):
    from kvbatch.engine import LLM

    path = with_tool_template(tiny_chat_model, tmp_path_factory.mktemp("tools") / "m")
    return LLM(
        model=str(path),
        device="cpu",
        max_model_len=MAX_LEN,
        max_num_seqs=16,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=16 * MiB,
    )


def tool_lines() -> list[dict]:
    named = {"type": "function", "function": {"name": "get_weather"}}
    common = {"tools": [WEATHER, TIME], "max_tokens": 48}
    return [
        chat("named", "Weather in Paris?", tool_choice=named, **common),
        chat("required", "What now?", tool_choice="required", parallel_tool_calls=False, **common),
        chat("auto", "Hello", **common),
        chat("none", "Hello", tool_choice="none", **common),
    ]


def check_calls(line: dict, finish: str = "tool_calls") -> list[dict]:
    """The choice's tool calls, each checked against its tool's schema."""
    [choice] = line["response"]["body"]["choices"]
    assert choice["finish_reason"] == finish, choice
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
        )
    return calls


def test_forced_tool_choices_answer_with_calls_that_match_the_schema(tmp_path: Path, tool_llm):
    out, errors, batch = run(tmp_path, tool_llm, tool_lines(), tool_call_parser="hermes")
    assert errors == [] and batch["request_counts"]["completed"] == 4
    by_id = {x["custom_id"]: x for x in out}
    [named] = check_calls(by_id["named"])
    assert named["function"]["name"] == "get_weather"
    [required] = check_calls(by_id["required"])
    assert required["function"]["name"] in SCHEMAS
    for plain in ("auto", "none"):  # a random model writes no <tool_call>: a plain answer
        [choice] = by_id[plain]["response"]["body"]["choices"]
        assert "tool_calls" not in choice["message"] and choice["finish_reason"] in (
            "stop",
            "length",
        )


def test_without_a_parser_auto_lines_are_refused_and_the_rest_answered(tmp_path: Path, tool_llm):
    out, errors, _ = run(tmp_path, tool_llm, tool_lines())
    assert [x["custom_id"] for x in out] == ["named", "required", "none"]
    [error] = errors
    assert error["custom_id"] == "auto" and error["error"]["code"] == "unsupported_parameter"
    assert "--tool-call-parser" in error["error"]["message"]


def test_workers_answer_tool_lines_as_kvbatch_run(tmp_path: Path, tool_llm):
    """prepare_job carries the tool reading (and the job's parser) in each shard request:
    run_shard answers exactly as `kvbatch run` does."""
    local, _, _ = run(tmp_path, tool_llm, tool_lines(), tool_call_parser="hermes")
    sub = prepare_job(
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "jobs"),
        tool_llm.engine.config.model,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_LEN,
        tool_call_parser="hermes",
    )
    job = job_dir(str(tmp_path / "jobs"), sub.job_id)
    run_shards(tool_llm, job, sub.messages)
    assert try_finalize(job) is not None
    with job.join("output.jsonl").open_read() as f:
        remote = [json.loads(x) for x in f.read().splitlines()]
    assert [x["custom_id"] for x in remote] == [x["custom_id"] for x in local]
    for a, b in zip(local, remote):
        a_choice, b_choice = (x["response"]["body"]["choices"][0] for x in (a, b))
        assert a_choice["finish_reason"] == b_choice["finish_reason"]
        calls = [
            [c["function"] for c in x["message"].get("tool_calls", [])]
            for x in (a_choice, b_choice)
        ]
        assert calls[0] == calls[1]
    check_calls(remote[0])


def test_the_kvbatch_run_command_takes_the_parser_flag(tmp_path: Path, tool_llm, capsys):
    """`kvbatch run --tool-call-parser hermes` (in process): the auto line is answered; an
    unknown parser is a usage error naming the known ones."""
    model = tool_llm.engine.config.model
    src = write_jsonl(tmp_path / "in.jsonl", tool_lines()[::2])  # named, auto
    flags = ["--model", model, "--device", "cpu", "--max-model-len", str(MAX_LEN), "--threads", "1",
             "--max-num-seqs", "8", "--kv-cache-bytes", "16MiB"]  # fmt: skip
    assert main(["run", str(src), "-o", str(tmp_path / "out.jsonl"), *flags,
                 "--tool-call-parser", "hermes"]) == 0  # fmt: skip
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [x["custom_id"] for x in out] == ["named", "auto"]
    check_calls(out[0])
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(src), *flags, "--tool-call-parser", "llama3_json"])
    assert exit_.value.code == 2 and "hermes" in capsys.readouterr().err

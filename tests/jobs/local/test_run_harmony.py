"""`kvbatch run` on a model that speaks harmony (a tiny random Llama with a gpt-oss tokenizer
built offline: tests/harmony_tokenizer.py): prompts rendered by openai-harmony, answers
split by channel with no special token in them, <|call|> and <|return|> ending an answer
although the checkpoint's generation config names neither. Every line an openai
ChatCompletion."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbatch.cli import main
from tests.jobs.local.test_run import chat, read_jsonl, write_jsonl
from tests.jobs.openai_format.test_conformance import check_line

pytestmark = pytest.mark.slow  # the gpt-oss tokenizer's conversion: about 15 s of CPU

RETURN, CALL = 200002, 200012


@pytest.fixture(scope="module")
def answers(harmony_model: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("harmony_run")
    lines = [
        chat("free", "Hi", max_tokens=12, reasoning_effort="high"),
        chat("call", "Hi", max_tokens=12, logit_bias={str(CALL): 100}),
        chat("return", "Hi", max_tokens=12, logit_bias={str(RETURN): 100}),
        chat("bad", "Hi", reasoning_effort="maximal"),
    ]
    src = write_jsonl(tmp / "in.jsonl", lines)
    out, errors = tmp / "out.jsonl", tmp / "errors.jsonl"
    argv = ["run", str(src), "-o", str(out), "--errors", str(errors), "--model",
            str(harmony_model), "--device", "cpu", "--threads", "1",
            "--kv-cache-bytes", "16MiB"]  # fmt: skip
    assert main(argv) == 0
    answered = [check_line(raw) for raw in out.read_text().splitlines()]
    return {x["custom_id"]: x for x in answered}, read_jsonl(errors)


def choice_of(line: dict) -> tuple[dict, dict]:
    body = line["response"]["body"]
    [choice] = body["choices"]
    return choice, body["usage"]


def test_answers_hold_no_special_token(answers):
    by_id, _ = answers
    choice, usage = choice_of(by_id["free"])
    message = choice["message"]
    assert "reasoning_content" in message
    for text in (message["content"], message["reasoning_content"]):
        assert text is None or "<|" not in text
    assert usage["prompt_tokens"] > 20  # harmony's system message, rendered


def test_call_and_return_end_the_answer(answers):
    by_id, _ = answers
    for custom_id in ("call", "return"):
        choice, usage = choice_of(by_id[custom_id])
        assert choice["finish_reason"] == "stop" and usage["completion_tokens"] == 1
        assert choice["message"]["content"] is None


def test_bad_reasoning_effort(answers):
    _, errors = answers
    [error] = errors
    assert error["custom_id"] == "bad" and error["error"]["code"] == "invalid_parameter"

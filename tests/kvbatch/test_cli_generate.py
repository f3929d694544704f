"""`kvbatch generate --chat-file`: a malformed conversation is refused before the model loads,
naming its line and what a message looks like (it was a jinja or transformers traceback from
inside the chat template, after the model had loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kvbatch.test_engine_args import run_main


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"messages": "hello"}\n', "'messages' "),
        (b'\n{"messages": [{"role": "user"}]}\n', "line 2: 'messages[0]' needs 'content'"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}\n', "'messages[0].role' must be"),
        (b'{"messages": []}\n', "'messages' "),
        (b'{"messages": [{"role": "user", "content": null}]}\n', "'messages[0]' needs 'content'"),
        (b"[1]\n", 'expected {"messages": [...]}'),
        (b"\xff\n", "is not UTF-8"),
        (b"\n\n", "holds no conversation"),
    ],
)
def test_a_bad_chat_file_is_refused_before_the_model_loads(tmp_path: Path, content, says):
    chat_file = tmp_path / "chats.jsonl"
    chat_file.write_bytes(content)
    model = str(tmp_path / "never-loaded")  # a model that does not exist: it is never reached
    status, out, err = run_main(["generate", "--model", model, "--chat-file", str(chat_file)])
    assert (status, out) == (2, "")
    [line] = err.strip().splitlines()
    assert line.startswith("kvbatch generate: ") and says in line, line
    assert "never-loaded" not in line


def test_a_missing_chat_file_is_named(tmp_path: Path):
    missing = str(tmp_path / "nope.jsonl")
    status, _, err = run_main(["generate", "--model", missing, "--chat-file", missing])
    assert status == 2 and f"cannot read --chat-file {missing}: No such file" in err


def test_nothing_to_answer_is_said_before_the_model_loads(tmp_path: Path):
    status, _, err = run_main(["generate", "--model", str(tmp_path / "never-loaded")])
    assert status == 2 and "nothing to answer: give --prompt TEXT or --chat-file FILE" in err

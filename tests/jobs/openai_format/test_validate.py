"""The streaming validator: one record per line, the right code and line number, never a stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvbatch.jobs.openai_format.validate as validate_module
from kvbatch.engine.core.sampling_params import SamplingParams
from kvbatch.jobs.openai_format.schemas import CONTEXT_MAX_TOKENS
from kvbatch.jobs.openai_format.validate import (
    CODES,
    JobRequest,
    LineError,
    read_lines,
    validate_lines,
)

MODEL = "SmolLM2-135M-Instruct"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "Hello"}]


def line(custom_id: object = None, url: str = CHAT, body: object = None, **top) -> bytes:
    obj: dict = {"custom_id": custom_id, "method": "POST", "url": url}
    if body is not None:
        obj["body"] = body
    obj.update(top)
    obj = {k: v for k, v in obj.items() if v is not None}
    return json.dumps(obj).encode() + b"\n"


# (raw line, expected: a LineError code, or the SamplingParams of a good line, or None for blank)
JOB: list[tuple[bytes, str | SamplingParams | None]] = [
    (
        line("ok-chat", body={"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 8}),
        SamplingParams(max_tokens=8, temperature=0.0),
    ),
    (b"{not json}\n", "invalid_json"),
    (b'["a list"]\n', "not_an_object"),
    (line(body={"messages": USER}), "missing_custom_id"),
    (line(custom_id=7, body={"messages": USER}), "invalid_custom_id"),
    (line("x" * 513, body={"messages": USER}), "invalid_custom_id"),
    (
        line(
            "ok-completion", COMPLETIONS, {"prompt": "Once", "top_p": 0.5, "seed": 3, "stop": ["."]}
        ),
        SamplingParams(max_tokens=16, top_p=0.5, seed=3, stop=["."]),
    ),
    (b"\n", None),
    (line("ok-chat", body={"messages": USER}), "duplicate_custom_id"),
    (line("bad-method", body={"messages": USER}, method="GET"), "invalid_method"),
    (line("bad-url", "/v1/moderations", {"input": "x"}), "invalid_url"),
    (line("no-body"), "invalid_body"),
    (line("other-model", body={"model": "gpt-4o", "messages": USER}), "model_mismatch"),
    (line("no-messages", body={"temperature": 0}), "missing_messages"),
    (line("no-prompt", COMPLETIONS, {"max_tokens": 3}), "missing_prompt"),
    (line("bad-role", body={"messages": [{"role": "robot", "content": "x"}]}), "invalid_messages"),
    (line("stream", body={"messages": USER, "stream": True}), "unsupported_parameter"),
    (
        line("tools", body={"messages": USER, "tools": [{"type": "function"}]}),
        "invalid_parameter",
    ),
    (line("typo", body={"messages": USER, "max_tokns": 3}), "unknown_parameter"),
    (line("hot", body={"messages": USER, "temperature": "hot"}), "invalid_parameter"),
    (line("range", COMPLETIONS, {"prompt": "x", "top_p": 1.5}), "invalid_parameter"),
    (line("empty-stop", COMPLETIONS, {"prompt": "x", "stop": ""}), "invalid_parameter"),
    (b"   \r\n", None),
    (b'{"custom_id": "latin1", "body": "caf\xe9"}\n', "invalid_encoding"),
    (
        line(
            "ok-logprobs",
            body={
                "messages": [{"role": "developer", "content": "Be brief."}, *USER],
                "logprobs": True,
                "top_logprobs": 2,
                "max_completion_tokens": 4,
                "top_k": 5,
                "min_p": 0.1,
                "ignore_eos": True,
                "user": "ignored",
            },
        ),
        SamplingParams(max_tokens=4, top_k=5, min_p=0.1, ignore_eos=True, logprobs=2),
    ),
    (
        line("ok-ids", COMPLETIONS, {"prompt": [1, 2, 3], "logprobs": 0, "max_tokens": 2}),
        SamplingParams(max_tokens=2, logprobs=0),
    ),
    (b'{"custom_id": "nan", "body": {"temperature": NaN}}\n', "invalid_json"),
    (line("too-long", COMPLETIONS, {"prompt": "x" * 5000}), "line_too_long"),  # see job_file
    (
        line("ok-chat-default", body={"messages": USER}),
        SamplingParams(max_tokens=CONTEXT_MAX_TOKENS),
    ),
]


@pytest.fixture
def job_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(validate_module, "MAX_LINE_BYTES", 4096)  # not 16 MiB: a fast test
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join(raw for raw, _ in JOB))
    return path


def test_every_line_gets_exactly_one_record(job_file: Path):
    with job_file.open("rb") as f:
        records = list(validate_lines(f, model=MODEL))
    expected = [(n, want) for n, (_, want) in enumerate(JOB, start=1) if want is not None]
    assert [r.line for r in records] == [n for n, _ in expected]  # blank lines: no record
    for record, (number, want) in zip(records, expected):
        if isinstance(want, str):
            assert isinstance(record, LineError), (number, record)
            assert record.code == want, (number, record)
            assert record.message.startswith(f"line {number}: "), record.message
        else:
            assert isinstance(record, JobRequest), (number, record)
            assert record.params == want, (number, record)
    bad_codes = {want for _, want in JOB if isinstance(want, str)}
    assert bad_codes == set(CODES)


def test_good_lines_carry_what_the_engine_needs(job_file: Path):
    with job_file.open("rb") as f:
        good = {r.custom_id: r for r in validate_lines(f, model=MODEL) if isinstance(r, JobRequest)}
    assert list(good) == ["ok-chat", "ok-completion", "ok-logprobs", "ok-ids", "ok-chat-default"]
    chat = good["ok-chat"]
    assert (chat.url, chat.messages, chat.prompt, chat.model) == (CHAT, USER, None, MODEL)
    assert chat.max_tokens == 8 and chat.logprobs is None and chat.is_chat
    lp = good["ok-logprobs"]
    assert lp.messages == [{"role": "system", "content": "Be brief."}, *USER]
    assert lp.logprobs == 2 and lp.max_tokens == 4
    assert good["ok-completion"].prompt == "Once" and good["ok-completion"].max_tokens is None
    assert good["ok-ids"].prompt == [1, 2, 3] and good["ok-ids"].logprobs == 0
    assert good["ok-chat-default"].max_tokens is None


def test_messages_say_what_to_fix(job_file: Path):
    with job_file.open("rb") as f:
        errors = {r.line: r for r in validate_lines(f, model=MODEL) if isinstance(r, LineError)}
    hot = next(e for e in errors.values() if e.custom_id == "hot")
    assert (
        hot.message == f"line {hot.line}: 'temperature' must be a number between 0 and 2, got 'hot'"
    )
    by_id = {e.custom_id: e.message for e in errors.values() if e.custom_id}
    assert "did you mean 'max_tokens'?" in by_id["typo"]
    assert "'stream' = True is not supported" in by_id["stream"]
    assert "'tools[0]' needs a 'function' object" in by_id["tools"]
    assert "'gpt-4o'" in by_id["other-model"] and MODEL in by_id["other-model"]
    assert "'/v1/moderations'" in by_id["bad-url"] and CHAT in by_id["bad-url"]
    assert "earlier line" in by_id["ok-chat"]
    assert "'messages[0].role'" in by_id["bad-role"] and "'robot'" in by_id["bad-role"]
    [encoding] = [e for e in errors.values() if e.code == "invalid_encoding"]
    at = JOB[encoding.line - 1][0].index(b"\xe9") + 1
    assert f"byte {at} is not UTF-8" in encoding.message and encoding.custom_id is None


def test_without_a_job_model_any_model_name_passes():
    records = list(validate_lines([line("a", body={"model": "gpt-4o", "messages": USER})]))
    assert isinstance(records[0], JobRequest) and records[0].model == "gpt-4o"


def test_several_problems_make_one_record_that_lists_them():
    raw = line(body={"messages": USER, "stream": True, "temperature": -1}, method="PUT")
    [record] = validate_lines([raw])
    assert record.code == "missing_custom_id" and record.custom_id is None
    for part in ("custom_id", "'method'", "'stream' = True", "'temperature'"):
        assert part in record.message


def test_the_first_of_a_duplicated_id_keeps_it_even_when_it_is_bad():
    records = list(validate_lines([line("a", body={"n": 2}), line("a", body={"messages": USER})]))
    assert [r.code for r in records] == ["missing_messages", "duplicate_custom_id"]
    assert [r.custom_id for r in records] == ["a", "a"]


def test_str_lines_bom_and_default_max_tokens():
    lines = [
        "\ufeff" + line("a", body={"messages": USER}).decode(),
        "",
        line("b", COMPLETIONS, {"prompt": "x"}).decode(),
    ]
    a, b = validate_lines(lines, default_max_tokens=100)
    assert a.params.max_tokens == 100 and a.max_tokens is None
    assert b.params.max_tokens == 16  # the job default is for chat; completions keep OpenAI's
    with pytest.raises(ValueError, match="default_max_tokens"):
        list(validate_lines([], default_max_tokens=0))


def test_line_too_long(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(validate_module, "MAX_LINE_BYTES", 200)
    long_line = line("long", COMPLETIONS, {"prompt": "x" * 300})
    records = list(
        validate_lines([long_line, long_line.decode(), line("short", COMPLETIONS, {"prompt": "x"})])
    )
    assert [r.code if isinstance(r, LineError) else "ok" for r in records] == [
        "line_too_long",
        "line_too_long",
        "ok",
    ]
    assert "200 bytes" in records[0].message


class CountingLines:
    """A binary file's lines, counting how many were handed out."""

    def __init__(self, f) -> None:
        self.f, self.read = f, 0

    def __iter__(self):
        for raw in self.f:
            self.read += 1
            yield raw


def test_validator_streams(tmp_path: Path):
    path = tmp_path / "big.jsonl"
    with path.open("wb") as f:
        for i in range(2000):
            f.write(line(f"r{i}", COMPLETIONS, {"prompt": f"prompt {i}"}))
    with path.open("rb") as f:
        lines = CountingLines(f)
        records = validate_lines(lines)
        assert lines.read == 0  # a generator: nothing read before the first record is asked for
        first = next(records)
        assert first.custom_id == "r0" and lines.read == 1
        assert f.tell() < path.stat().st_size  # the file is not exhausted
        assert sum(1 for _ in records) == 1999


def _raw(custom_id: str = "r", **body) -> bytes:
    return line(custom_id, COMPLETIONS, {"prompt": "hi", **body}).rstrip(b"\n")


# Line framing and values a hostile or careless file holds, beside what test_schemas checks:
# (raw line, its record's code or "ok", a part of its message or its custom_id)
FRAMING = [
    pytest.param(b"\xef\xbb\xbf" + _raw("bom") + b"\r\n", "ok", "bom", id="utf8-bom-and-crlf"),
    pytest.param(_raw("no-newline"), "ok", "no-newline", id="last-line-without-newline"),
    pytest.param(_raw("../../etc/passwd"), "ok", "../../etc/passwd", id="custom-id-path"),
    pytest.param(_raw("a\nb\x00c"), "ok", "a\nb\x00c", id="custom-id-control-chars"),
    pytest.param(_raw("x" * 10_000), "invalid_custom_id", "at most 512", id="custom-id-10k"),
    pytest.param(_raw("nul", prompt="a\x00b"), "ok", "nul", id="nul-escape-in-prompt"),
    pytest.param(_raw("raw-nul")[:-1] + b"\x00}", "invalid_json", "not valid JSON", id="raw-nul"),
    pytest.param(
        _raw("digits")[:-2] + b', "max_tokens": ' + b"9" * 5000 + b"}}",
        "invalid_json",
        "a number has 5000 digits",
        id="5000-digit-number",
    ),
    pytest.param(
        b'{"custom_id": "deep", "body": ' + b'{"a": ' * 10_000 + b"1" + b"}" * 10_001,
        "invalid_json",
        "nest too deeply",
        id="objects-10000-deep",
    ),
    pytest.param(b"\x1f\x8b\x08\x00\xb5\xc9", "invalid_encoding", "gzip-compressed", id="gzip"),
    pytest.param('{"custom_id": "u"}'.encode("utf-16"), "invalid_encoding", "UTF-16", id="utf-16"),
    pytest.param(_raw("inf")[:-2] + b', "temperature": 1e400}}', "invalid_parameter", "got inf"),
    pytest.param(_raw("f", max_tokens=1e9), "invalid_parameter", "'max_tokens' must be an integer"),
    pytest.param(_raw("n", n=2.0), "invalid_parameter", "'n' must be an integer"),
    pytest.param(_raw("s", stop=["a", ""]), "invalid_parameter", "non-empty strings"),
    pytest.param(_raw("lp", logprobs=5), "ok", "lp"),
    pytest.param(_raw("lp6", logprobs=6), "invalid_parameter", "between 0 and 5"),
    pytest.param(
        line("tl20", body={"messages": USER, "logprobs": True, "top_logprobs": 20}).rstrip(),
        "ok",
        "tl20",
    ),
    pytest.param(
        line("tl21", body={"messages": USER, "logprobs": True, "top_logprobs": 21}).rstrip(),
        "invalid_parameter",
        "between 0 and 20",
    ),
]


@pytest.mark.parametrize(("raw", "code", "says"), FRAMING)
def test_hostile_framing_and_values(raw: bytes, code: str, says: str):
    [record] = validate_lines([raw], model=MODEL)
    if code == "ok":
        assert isinstance(record, JobRequest), record
        assert record.custom_id == says  # echoed as given: it is never a path
    else:
        assert isinstance(record, LineError) and record.code == code, record
        assert says in record.message and len(record.message) < 400, record.message


def test_an_oversized_line_is_never_held_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Iterating the file read a line of any length into memory before its length was checked."""
    monkeypatch.setattr(validate_module, "MAX_LINE_BYTES", 200)
    long_line = line("long", COMPLETIONS, {"prompt": "x" * 5000})
    path = tmp_path / "in.jsonl"
    path.write_bytes(long_line + line("short", COMPLETIONS, {"prompt": "x"}) + long_line[:-1])
    with path.open("rb") as f:
        raws = list(read_lines(f))
    assert [len(r) for r in raws] == [201, len(line("short", COMPLETIONS, {"prompt": "x"})), 201]
    records = list(validate_lines(raws))
    assert [r.code if isinstance(r, LineError) else r.custom_id for r in records] == [
        "line_too_long",
        "short",
        "line_too_long",
    ]
    assert f"the line is {len(long_line)} bytes" in records[0].message
    assert f"the line is {len(long_line) - 1} bytes" in records[2].message

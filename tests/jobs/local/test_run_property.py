"""A property of `kvbatch run` over arbitrary input files (hypothesis): whatever each line holds
(any JSON value, request-shaped objects with odd fields, raw bytes, lone surrogate escapes,
deep nesting, huge numbers), the run completes, each good line is answered exactly once and
each other line has exactly one error record with its line number."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbatch.jobs.local.run import RunOptions, run_job
from tests.jobs.local.test_run import llm  # noqa: F401  (the module's engine fixture)

GOOD = "good-"
ANY_CHAR = st.characters(blacklist_categories=())  # surrogates included
TEXT = st.text(ANY_CHAR, max_size=12)
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=10**30, max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True),
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | NUMBERS | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
NOT_GOOD_ID = st.one_of(TEXT, JSON_VALUES).filter(
    lambda v: not (isinstance(v, str) and v.startswith(GOOD))
)
URLS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v2/x"])


@st.composite
def request_like(draw) -> bytes:
    """An object shaped like a request, with odd values in its fields."""
    body = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "prompt": st.one_of(TEXT, JSON_VALUES),
                "messages": st.one_of(
                    st.lists(st.fixed_dictionaries({"role": TEXT, "content": TEXT}), max_size=2),
                    JSON_VALUES,
                ),
                "max_tokens": st.one_of(st.integers(-2, 2), NUMBERS),
                "temperature": NUMBERS,
                "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
                "model": TEXT,
                "n": st.integers(-1, 3),
            },
        )
    )
    line = {"custom_id": draw(NOT_GOOD_ID), "method": "POST", "url": draw(URLS), "body": body}
    if draw(st.booleans()):
        line[draw(TEXT)] = draw(JSON_VALUES)
    return json.dumps(line).encode()


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


JUNK = st.one_of(
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    request_like(),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
    st.integers(1, 200_000).map(deep),
    st.integers(4301, 6000).map(lambda n: b'{"custom_id": "x", "n": ' + b"7" * n + b"}"),
    st.sampled_from([rb'{"custom_id": "\ud800"}', rb'{"\udfff": 1}', b"1e400", b"[" * 100_000]),
)


@st.composite
def job_files(draw) -> tuple[list[bytes], set[int]]:
    """Lines of a file and the 1-based numbers of its good lines."""
    lines: list[bytes] = []
    good: set[int] = set()
    for n in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            # Words the tokenizer keeps (some characters alone tokenize to nothing, which is
            # rightly an invalid_prompt error).
            prompt = draw(st.text("abcdefghij XYZ.,!é", min_size=1, max_size=20).map(str.strip))
            prompt = prompt or "hello"
            line = {
                "custom_id": f"{GOOD}{n}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": prompt, "max_tokens": 1},
            }
            lines.append(json.dumps(line).encode())
            good.add(len(lines))
        else:
            lines.append(draw(JUNK))
    return lines, good


@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(job=job_files())
def test_every_line_gets_exactly_one_record(llm, job):  # noqa: F811
    lines, good = job
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "in.jsonl"
        source.write_bytes(b"\n".join(lines) + b"\n")
        opts = RunOptions(input=str(source), model="unused", output=str(Path(tmp) / "out.jsonl"))
        record = run_job(opts, llm=llm)
        answers = _read(Path(tmp) / "out.jsonl")
        errors = _read(Path(tmp) / "out.errors.jsonl")
    counted = [n for n, raw in enumerate(lines, 1) if raw and not raw.isspace()]
    error_lines = [e["error"]["line"] for e in errors]
    assert len(error_lines) == len(set(error_lines)), errors
    assert set(error_lines) <= set(counted) - good
    answered = [a["custom_id"] for a in answers]
    assert len(answered) == len(set(answered))
    assert {f"{GOOD}{n}" for n in range(8)} & set(answered) == {
        json.loads(lines[n - 1])["custom_id"] for n in good
    }
    assert len(answers) + len(errors) == len(counted)
    assert (record.completed, record.failed) == (len(answers), len(errors))


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]

"""A property of `kvbatch run` over arbitrary input files (hypothesis): whatever each line holds
(any JSON value, request-shaped objects with odd fields, raw bytes, lone surrogate escapes,
deep nesting, huge numbers), the run completes, each good line is answered exactly once and
each other line has exactly one error record with its line number. Sampling parameters at the
limits of the floating-point types the sampler may compute in get a valid answer or an error
record naming the parameter, never an answer made of NaN logits."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
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


def _limits(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    return [info.smallest_normal, info.tiny / 2**10, info.max, info.eps, 1 - info.eps / 2]


# Where float32, bfloat16 and float16 (and float64, which JSON numbers are) run out: the
# smallest subnormal-ish and normal values, the largest, epsilon and the float just under 1.
# 1e-46 and 1e-300 round to 0 in float32; 3.5e38 overflows it.
DTYPE_LIMITS = sorted(
    {v for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64) for v in _limits(d)}
    | {1e-46, 1e-300, 5e-324, 3.5e38, 1.7976931348623157e308}
)


@st.composite
def near_dtype_limits(draw) -> float:
    """A float at, or a hair either side of, one of DTYPE_LIMITS, of either sign."""
    limit = draw(st.sampled_from(DTYPE_LIMITS))
    value = limit * draw(st.sampled_from([1.0, 0.999, 1.001, 0.5, 2.0]))
    value = value if value != float("inf") else limit  # JSON has no infinity
    return value * draw(st.sampled_from([1.0, 1.0, -1.0]))


FLOAT_PARAMETERS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@st.composite
def limit_float_lines(draw) -> tuple[list[dict], dict[str, list[str]]]:
    """Completions whose sampling floats sit at the dtypes' limits, and the parameters each
    line set (what its error, if it gets one, must name)."""
    lines, named = [], {}
    for n in range(draw(st.integers(1, 4))):
        params = draw(
            st.dictionaries(st.sampled_from(FLOAT_PARAMETERS), near_dtype_limits(), min_size=1)
        )
        custom_id = f"float-{n}"
        body = {"prompt": "count to three:", "max_tokens": 2, "seed": n, **params}
        lines.append({"custom_id": custom_id, "method": "POST", "url": "/v1/completions"})
        lines[-1]["body"] = body
        named[custom_id] = sorted(params)
    return lines, named


@settings(
    max_examples=15,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(job=limit_float_lines())
def test_floats_at_the_dtype_limits_get_an_answer_or_an_error_naming_them(llm, job):  # noqa: F811
    lines, named = job
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "in.jsonl"
        source.write_bytes(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        opts = RunOptions(input=str(source), model="unused", output=str(Path(tmp) / "out.jsonl"))
        run_job(opts, llm=llm)
        answers = _read(Path(tmp) / "out.jsonl")
        errors = _read(Path(tmp) / "out.errors.jsonl")
    got = [r["custom_id"] for r in answers + errors]
    assert sorted(got) == sorted(named), (answers, errors)
    for answer in answers:
        body = answer["response"]["body"]
        (choice,) = body["choices"]
        assert choice["finish_reason"] in ("stop", "length"), answer
        assert 1 <= body["usage"]["completion_tokens"] <= 2, answer
        assert choice["finish_reason"] == "stop" or choice["text"], answer  # not 2 empty tokens
    for error in errors:
        message = error["error"]["message"]
        params = named[error["custom_id"]]
        assert any(p in message for p in params), (params, message)


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

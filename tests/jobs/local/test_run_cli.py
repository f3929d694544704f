"""`kvbatch run` as a process: exit codes and messages, and a run killed with SIGKILL that
`--resume` finishes. The job itself is tested in process in test_run.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbatch.jobs.local.run import RunOptions, resolve_paths, run_job
from tests.jobs.local.test_run import (
    CHAT,
    COMPLETIONS,
    answer_text,
    chat,
    completion,
    read_jsonl,
    url_of,
    write_jsonl,
)
from tests.s3_server import S3Server

ROOT = Path(__file__).resolve().parents[3]
# The engine flags of every run here; the in-process reference run uses the same settings.
ENGINE_FLAGS = ["--device", "cpu", "--max-model-len", "256", "--max-num-seqs", "8"]
ENGINE_KWARGS = dict(device="cpu", max_model_len=256, max_num_seqs=8)


def kvbatch(*args: str, **popen) -> subprocess.Popen:
    """Start `python -m kvbatch.cli ARGS` (its stdout/stderr go where `popen` says)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvbatch.cli", *args], cwd=ROOT, env=env, **popen
    )


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = kvbatch(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "cache"))


def one_clear_message(result: subprocess.CompletedProcess, *names: str) -> str:
    """A failed run: exit status 1, nothing on stdout, one line on stderr naming `names`."""
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvbatch run: ")
    for name in names:
        assert name in lines[0]
    return lines[0]


# -- failures before any work --------------------------------------------------------------------


def test_missing_input_exits_1_naming_it(tmp_path: Path):
    missing = tmp_path / "nope.jsonl"
    result = run_cli("run", str(missing), "--model", str(tmp_path / "no-model"), *ENGINE_FLAGS)
    assert "not found" in one_clear_message(result, str(missing))
    assert not any(p.name != "cache" for p in tmp_path.iterdir())


@pytest.mark.slow
def test_missing_s3_object_and_bucket_exit_1_naming_them(s3_server: S3Server, tmp_path: Path):
    bucket = s3_server.make_bucket()
    model = str(tmp_path / "no-model")
    uri = f"s3://{bucket}/jobs/missing.jsonl"
    result = run_cli("run", uri, "-o", str(tmp_path / "out.jsonl"), "--model", model)
    assert "not found" in one_clear_message(result, uri)
    uri = "s3://no-such-bucket-kvbatch/jobs/in.jsonl"
    result = run_cli("run", uri, "-o", str(tmp_path / "out.jsonl"), "--model", model)
    assert "does not exist" in one_clear_message(result, uri, "'no-such-bucket-kvbatch'")
    assert not (tmp_path / "out.jsonl").exists()


def test_unwritable_output_exits_1_before_inference(tmp_path: Path):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("a", "hi")])
    (tmp_path / "results").write_text("a file, not a folder")
    output = tmp_path / "results" / "out.jsonl"
    result = run_cli("run", str(source), "-o", str(output), "--model", str(tmp_path / "nope"))
    assert "is a file" in one_clear_message(result, str(output), str(tmp_path / "results"))


def test_stdin_input_needs_an_output(tmp_path: Path):
    result = run_cli("run", "-", "--model", str(tmp_path / "nope"))
    assert "-o OUTPUT" in one_clear_message(result)


def test_empty_input_exits_0_with_zero_requests(
    tiny_chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    """In process (main() returns the exit status): loading the model in a subprocess costs
    seconds, and the SIGKILL test below already runs a whole job through one."""
    import logging

    from kvbatch.cli import main

    source = tmp_path / "empty.jsonl"
    source.write_bytes(b"")
    levels = {n: logging.getLogger(n).level for n in ("kvbatch",)}
    try:
        status = main(["run", str(source), "--model", str(tiny_chat_model), *ENGINE_FLAGS])
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "0 answered, 0 failed" in err
    assert f"answers: {tmp_path / 'empty.output.jsonl'}" in out
    batch = json.loads((tmp_path / "empty.output.batch.json").read_text())
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert (tmp_path / "empty.output.jsonl").read_bytes() == b""


def test_every_line_refused_exits_1_naming_the_errors(
    tiny_chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    """A batch where nothing could run is `failed`: `kvbatch run && next-step` must stop."""
    import logging

    from kvbatch.cli import main

    source = tmp_path / "bad.jsonl"
    source.write_text('{"custom_id": "a"}\nnot json\n')
    level = logging.getLogger("kvbatch").level
    try:
        status = main(["run", str(source), "--model", str(tiny_chat_model), *ENGINE_FLAGS])
    finally:
        logging.getLogger("kvbatch").setLevel(level)
    out, err = capsys.readouterr()
    assert status == 1, err
    errors = tmp_path / "bad.output.errors.jsonl"
    assert f"the batch failed: every line was refused; see {errors}" in err
    assert len(errors.read_text().splitlines()) == 2
    batch = json.loads((tmp_path / "bad.output.batch.json").read_text())
    assert batch["status"] == "failed"


# -- SIGKILL, then --resume ----------------------------------------------------------------------


def _wait_for_commit(proc: subprocess.Popen, partial: Path, timeout: float = 60) -> None:
    """Return once `partial` holds at least one whole line (a committed batch of answers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if partial.exists() and partial.read_bytes().count(b"\n") >= 2:  # header + an answer
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (status {proc.returncode}) before it could be killed")
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no answer was committed to {partial} within {timeout} s")


@pytest.mark.slow
def test_sigkill_then_resume_answers_each_request_once(tiny_chat_model: Path, tmp_path: Path):
    from kvbatch.engine import LLM

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu".split()
    lines = []
    for i in range(300):  # ~2 s at 8 sequences at a time: the kill lands mid-way
        text = " ".join(words[j % len(words)] for j in range(i % 17, i % 17 + 3 + i % 11))
        make = chat if i % 3 else completion
        lines.append(make(f"req-{i}", f"{text} {i}", max_tokens=8))
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out" / "answers.jsonl"
    args = ["run", str(source), "-o", str(output), "--model", str(tiny_chat_model)]
    args += [*ENGINE_FLAGS, "--window", "16"]
    partial = resolve_paths(RunOptions(input=str(source), model="", output=str(output))).partial

    proc = kvbatch(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_commit(proc, partial)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not output.exists()  # killed before finalizing
    data = partial.read_bytes()
    committed = data[: data.rfind(b"\n") + 1].splitlines()[1:]  # after the header line
    assert 1 <= len(committed) < len(lines)
    done = [json.loads(line)["record"]["custom_id"] for line in committed]
    # A torn last line, as a kill in the middle of a write leaves it.
    victim = next(line for line in lines if line["custom_id"] not in done)
    partial.write_bytes(
        data + b'{"id": "batch_req_0", "custom_id": "' + victim["custom_id"].encode()
    )

    result = run_cli(*args, "--resume")
    assert result.returncode == 0, result.stderr
    assert f"resuming: {len(done)} requests already answered" in result.stderr
    assert f"ran {len(lines) - len(done)} requests" in result.stderr
    assert not partial.exists()
    # Nothing of the killed run is left beside the output (partial file, spilled prompts).
    assert sorted(p.name for p in output.parent.iterdir()) == [
        "answers.batch.json",
        "answers.errors.jsonl",
        "answers.jsonl",
    ]

    out = read_jsonl(output)
    assert [line["custom_id"] for line in out] == [line["custom_id"] for line in lines]
    assert read_jsonl(output.with_name("answers.errors.jsonl")) == []
    batch = json.loads(output.with_name("answers.batch.json").read_text())
    assert batch["request_counts"] == {"total": 300, "completed": 300, "failed": 0}

    # The greedy answers are those of an uninterrupted run with the same settings.
    reference_out = tmp_path / "reference.jsonl"
    llm = LLM(model=str(tiny_chat_model), kv_cache_bytes=64 << 20, **ENGINE_KWARGS)
    run_job(RunOptions(input=str(source), model="", output=str(reference_out)), llm=llm)

    reference = read_jsonl(reference_out)
    assert [answer_text(line) for line in out] == [answer_text(line) for line in reference]
    assert {url_of(line) for line in out} == {CHAT, COMPLETIONS}

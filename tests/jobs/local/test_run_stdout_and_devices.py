"""`kvbatch run` with outputs and inputs that are not plain files: two runs of one input to
stdout at once keep their partial answers apart, and an input that never ends (/dev/zero) is
refused before the model loads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvbatch.jobs.local.output_lock import output_lock
from kvbatch.jobs.local.run import JobError, RunOptions, resolve_paths, run_job
from tests.jobs.local.test_run import (
    completion,
    llm,  # noqa: F401  (the module's engine fixture)
    plant_partial,
    read_jsonl,
    write_jsonl,
)
from tests.jobs.local.test_run_cli import kvbatch, one_clear_message
from tests.jobs.local.test_run_fails_early import no_model_load  # noqa: F401  (fixture)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "cache"))


# -- two runs to stdout ---------------------------------------------------------------------------


def test_a_run_to_stdout_leaves_another_runs_partial_answers_alone(
    llm,  # noqa: F811
    tmp_path: Path,
    capsysbinary: pytest.CaptureFixture,
):
    """Run A (to stdout) holds the partial output of its input, with an answer committed; run
    B of the same input to stdout starts meanwhile. B answers every line itself and prints only
    its own answers; A's partial answers stay as A left them (B once deleted them, and A then
    printed B's answers as its own)."""
    lines = [completion(f"r{i}", f"count {i}", max_tokens=2) for i in range(3)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="unused", output="-")
    theirs = {"custom_id": "r0", "response": {"body": {"usage": {"prompt_tokens": 1}}}}
    theirs["error"] = None
    partial = plant_partial(opts, lines, [theirs])
    before = partial.read_bytes()

    with output_lock(str(partial), "run A"):  # run A, still going
        record = run_job(opts, llm=llm)
        assert partial.read_bytes() == before
    out, _ = capsysbinary.readouterr()
    answers = read_jsonl(out)
    assert [a["custom_id"] for a in answers] == ["r0", "r1", "r2"]
    assert all(a["response"]["status_code"] == 200 for a in answers)  # not A's planted record
    assert (record.completed, record.failed) == (3, 0)
    # B's own partial output and its spilled prompts are gone; A's is where A left it.
    assert sorted(p.name for p in partial.parent.iterdir()) == [partial.name]


def test_resume_to_stdout_while_the_run_it_continues_is_going_is_refused(
    tmp_path: Path,
    no_model_load: str,  # noqa: F811
):
    lines = [completion("r0", "count")]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model=no_model_load, output="-", resume=True)
    partial = resolve_paths(opts).partial
    partial.parent.mkdir(parents=True)
    with output_lock(str(partial), "run A"):
        with pytest.raises(JobError, match="in use by another run to stdout") as err:
            run_job(opts, llm=None)
    assert str(partial) in str(err.value)


# -- inputs that never end --------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_input_is_refused_before_loading_the_model(
    tmp_path: Path,
    no_model_load: str,  # noqa: F811
    device: str,
):
    out = tmp_path / "out.jsonl"
    with pytest.raises(JobError, match=f"{device} is a character device") as err:
        run_job(RunOptions(input=device, model=no_model_load, output=str(out)), llm=None)
    assert "pipe the job in" in str(err.value)
    assert not any(tmp_path.iterdir())  # no output, lock, partial file or token folder


def test_dev_zero_on_stdin_is_one_message_before_loading_the_model(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    with open("/dev/zero", "rb") as zero:
        proc = kvbatch(
            "run", "-", "-o", str(out), "--model", str(tmp_path / "no-model"),
            stdin=zero, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        stdout, stderr = proc.communicate(timeout=120)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    one_clear_message(result, "input '-' (stdin) is a character device")
    assert not any(tmp_path.iterdir())


def test_dev_null_is_still_an_empty_job(tmp_path: Path, no_model_load: str):  # noqa: F811
    out = tmp_path / "out.jsonl"
    record = run_job(RunOptions(input="/dev/null", model=no_model_load, output=str(out)))
    assert (record.total, record.status) == (0, "failed")
    assert json.loads((tmp_path / "out.batch.json").read_text())["errors"]["data"][0]["code"] == (
        "empty_file"
    )

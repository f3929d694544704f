"""`kvbatch run` on input it cannot use fails before any work: a missing or unreadable input,
an output it cannot write, a model it cannot load, each a JobError naming what to fix, raised
before the model loads or before any inference (nothing written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbatch.jobs.local.run import JobError, RunOptions, run_job
from tests.jobs.local.test_run import chat, write_jsonl
from tests.s3_server import S3Server


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> str:
    """A model path that does not exist, and an engine.LLM that fails the test if built: a job
    that must fail before loading the model runs with llm=None and this path."""
    from kvbatch import engine

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded: the job should have failed before")

    monkeypatch.setattr(engine, "LLM", refuse)
    return "/nonexistent/model/folder"


def test_missing_local_input_fails_before_loading_the_model(tmp_path: Path, no_model_load: str):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(JobError, match=str(missing)) as err:
        run_job(RunOptions(input=str(missing), model=no_model_load), llm=None)
    assert "not found" in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing written: no output, no partial file


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("missing/in.jsonl", "not found"),
        ("folder/", "not an object"),
    ],
)
def test_unreadable_s3_input_fails_before_loading_the_model(
    s3_server: S3Server, tmp_path: Path, no_model_load: str, key: str, says: str
):
    bucket = s3_server.make_bucket()
    s3_server.client().put_object(Bucket=bucket, Key="folder/x.jsonl", Body=b"{}\n")
    uri = f"s3://{bucket}/{key}"
    opts = RunOptions(input=uri, model=no_model_load, output=str(tmp_path / "out.jsonl"))
    with pytest.raises(JobError, match=uri) as err:
        run_job(opts, llm=None)
    assert says in str(err.value)
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_bucket_fails_before_loading_the_model(
    s3_server: S3Server, tmp_path: Path, no_model_load: str
):
    uri = "s3://no-such-bucket-kvbatch/in.jsonl"
    opts = RunOptions(input=uri, model=no_model_load, output=str(tmp_path / "out.jsonl"))
    with pytest.raises(JobError, match="no-such-bucket-kvbatch") as err:
        run_job(opts, llm=None)
    assert "does not exist" in str(err.value)


def test_unwritable_output_fails_before_any_inference(tmp_path: Path, no_model_load: str):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("a", "hi")])
    blocker = tmp_path / "results"
    blocker.write_text("a file where the output's folder should be")
    opts = RunOptions(input=str(source), model=no_model_load, output=str(blocker / "out.jsonl"))
    with pytest.raises(JobError, match="is a file") as err:
        run_job(opts, llm=None)
    assert str(blocker) in str(err.value)


def test_unwritable_errors_file_fails_before_any_inference(tmp_path: Path, no_model_load: str):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("a", "hi")])
    (tmp_path / "errs").write_text("")
    opts = RunOptions(
        input=str(source), model=no_model_load, errors=str(tmp_path / "errs" / "e.jsonl")
    )
    with pytest.raises(JobError, match="is a file"):
        run_job(opts, llm=None)
    assert not (tmp_path / "in.output.jsonl").exists()


def test_output_to_a_missing_bucket_fails_before_any_inference(
    s3_server: S3Server, tmp_path: Path, no_model_load: str
):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("a", "hi")])
    opts = RunOptions(
        input=str(source), model=no_model_load, output="s3://no-such-bucket-kvbatch/out.jsonl"
    )
    with pytest.raises(JobError, match="no-such-bucket-kvbatch"):
        run_job(opts, llm=None)


def test_unloadable_model_is_a_job_error(tmp_path: Path):
    source = write_jsonl(tmp_path / "in.jsonl", [chat("a", "hi")])
    with pytest.raises(JobError, match="cannot load the model"):
        run_job(RunOptions(input=str(source), model=str(tmp_path / "no-model")), llm=None)

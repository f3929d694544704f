"""`kvbatch run` says the same thing whatever way a job goes: exit status 1 when no line was
answered (refused at validation or in the engine), no model loaded for a job where no line
can run, no partial file named that was never written, an embeddings run summarised in its own
words, and errors that say what is wrong (a negative token id is negative, not "a mix")."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvbatch.cli import main
from kvbatch.jobs.local.run import RunOptions, resolve_paths, run_job
from kvbatch.jobs.openai_format.validate import LineError, validate_lines
from tests.engine.pooling.st_checkpoints import build_embedding_checkpoint
from tests.jobs.local.test_run import completion, read_jsonl, write_jsonl
from tests.jobs.local.test_run_cli import ENGINE_FLAGS, kvbatch
from tests.jobs.local.test_run_fails_early import no_model_load  # noqa: F401  (fixture)

EMBED = "/v1/embeddings"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "cache"))


def run_main(*args: str) -> int:
    """`kvbatch run ARGS` in process (loading a model in a subprocess costs seconds)."""
    level = logging.getLogger("kvbatch").level
    try:
        return main(["run", *args])
    finally:
        logging.getLogger("kvbatch").setLevel(level)


def test_every_line_failing_in_the_engine_exits_1(
    tiny_chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    """A logit_bias for a token id the vocabulary lacks passes validation and is refused by
    the engine: no line is answered, so `kvbatch run && next-step` must stop, as when
    validation refuses every line."""
    lines = [completion(f"bad-{i}", "hi", logit_bias={"999999": 5}) for i in range(2)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    status = run_main(str(source), "--model", str(tiny_chat_model), *ENGINE_FLAGS)
    _, err = capsys.readouterr()
    assert status == 1, err
    errors = tmp_path / "in.output.errors.jsonl"
    assert f"the batch failed: every line failed; see {errors}" in err
    refused = read_jsonl(errors)
    assert [e["error"]["code"] for e in refused] == ["invalid_prompt"] * 2
    assert "logit_bias names token id 999999" in refused[0]["error"]["message"]


def test_a_job_where_no_line_can_run_never_loads_the_model(
    tmp_path: Path,
    no_model_load: str,  # noqa: F811
):
    source = write_jsonl(tmp_path / "in.jsonl", ['{"custom_id": "a"}', "not json", ""])
    record = run_job(RunOptions(input=str(source), model=no_model_load), llm=None)
    assert (record.status, record.total, record.failed) == ("failed", 2, 2)
    assert len(read_jsonl(tmp_path / "in.output.errors.jsonl")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.jsonl",
        "in.output.batch.json",
        "in.output.errors.jsonl",
        "in.output.jsonl",
    ]


def test_a_mistyped_model_is_named_even_when_no_line_needed_it(
    tmp_path: Path,
    no_model_load: str,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
):
    source = write_jsonl(tmp_path / "in.jsonl", ['{"custom_id": "a"}'])
    with caplog.at_level(logging.WARNING, logger="kvbatch"):
        record = run_job(RunOptions(input=str(source), model=no_model_load), llm=None)
    assert record.status == "failed"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"model {no_model_load!r} does not exist" in warning
    caplog.clear()
    folder = tmp_path / "a-folder"  # exists: not a typo, and still never loaded
    folder.mkdir()
    with caplog.at_level(logging.WARNING, logger="kvbatch"):
        run_job(RunOptions(input=str(source), model=str(folder)), llm=None)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(("value", "bad"), [([-1], -1), ([7, -3], -3), ([[2], [-5]], -5)])
def test_a_negative_embedding_token_id_is_called_negative(value, bad):
    line = {"custom_id": "e", "method": "POST", "url": EMBED}
    line["body"] = {"model": "m", "input": value}
    (item,) = validate_lines([json.dumps(line).encode()])
    assert isinstance(item, LineError)
    assert f"token id {bad} is negative" in item.message, item.message
    assert "mix" not in item.message


def test_ctrl_c_while_the_model_loads_names_no_partial_file(tiny_chat_model: Path, tmp_path: Path):
    """Ctrl-C once the run has begun (its partial output is open) and is loading the model
    (importing torch, reading the weights: seconds): nothing was answered, so the message
    offers nothing to resume, and no partial file is left."""
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi")])
    partial = resolve_paths(RunOptions(input=str(source), model="")).partial
    proc = kvbatch(
        "run", str(source), "--model", str(tiny_chat_model), *ENGINE_FLAGS,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not partial.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    (line,) = err.strip().splitlines()[-1:]
    assert line.startswith("kvbatch run: interrupted"), err
    assert "partial" not in line and "--resume" not in line, line
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["in.jsonl"]


def test_an_embeddings_run_counts_inputs_and_vectors(
    tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
):
    model = build_embedding_checkpoint(tmp_path / "embedder", mode="mean")
    lines = [
        {"custom_id": "one", "method": "POST", "url": EMBED, "body": {"input": "a b c"}},
        {"custom_id": "three", "method": "POST", "url": EMBED, "body": {"input": ["a", "b", "c"]}},
    ]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    with caplog.at_level(logging.INFO, logger="kvbatch"):
        status = run_main(str(source), "--model", str(model), "--device", "cpu")
    _, err = capsys.readouterr()
    assert status == 0, err
    summary = [line for line in err.splitlines() if line.startswith("kvbatch run: ")][-1]
    assert summary.startswith("kvbatch run: 2 answered with 4 vectors ("), summary
    # What the run says (the engine's own log lines about sizing the KV cache aside)
    said = "\n".join(r.getMessage() for r in caplog.records if r.name == "kvbatch.run") + err
    for words in ("tok/s", "prefix hit", "output tokens", "cached_tokens", "requests"):
        assert words not in said, said
    assert "embedded 4 inputs" in said

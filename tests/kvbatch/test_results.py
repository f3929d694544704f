"""`kvbatch results`: a distributed job's merged answers to a file, stdout or S3, merging the
job when its shards are all written; a job still running says how far it is (exit 3). The job
is prepared and its shards run in process on the tiny engine (tests/jobs/distributed/test_finalize.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.jobs.distributed.finalize import read_manifest
from kvbatch.jobs.distributed.shards import job_dir
from tests.jobs.distributed.test_finalize import make_llm, run_shards  # noqa: F401
from tests.jobs.distributed.test_submit import prepare, rag_lines
from tests.kvbatch.test_engine_args import run_main
from tests.s3_server import S3Server

ROOT = Path(__file__).resolve().parents[2]


def _results(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", "results", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_results_of_a_running_then_finished_job(tmp_path, make_llm, tiny_chat_model):  # noqa: F811
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=400)
    prefix = str(tmp_path / "out")
    job = job_dir(prefix, sub.job_id)
    llm = make_llm()
    run_shards(llm, job, sub.messages[:1])

    running = _results(sub.job_id, "--output", prefix)
    assert running.returncode == 3 and running.stdout == ""
    assert "in_progress" in running.stderr and f"kvbatch status {sub.job_id}" in running.stderr
    assert not (Path(prefix) / sub.job_id / "output.jsonl").exists()

    run_shards(llm, job, sub.messages[1:])  # the last shard's finalizer "lost": results merges
    stdout = _results(sub.job_id, "--output", prefix)
    assert stdout.returncode == 0, stdout.stderr
    answers = [json.loads(line) for line in stdout.stdout.splitlines()]
    manifest = read_manifest(job)
    assert answers and all(a["response"]["status_code"] == 200 for a in answers)

    to_file = _results(sub.job_id, "--output", prefix, "-o", str(tmp_path / "answers.jsonl"))
    assert to_file.returncode == 0, to_file.stderr
    assert (tmp_path / "answers.jsonl").read_text() == stdout.stdout
    assert str(tmp_path / "answers.jsonl") in to_file.stderr

    errors = _results(sub.job_id, "--output", prefix, "--errors")
    assert errors.returncode == 0
    failed = len(errors.stdout.splitlines())
    assert failed >= manifest["num_invalid"] > 0
    assert len(answers) + failed == manifest["num_requests"] + manifest["num_invalid"]


def test_results_to_s3_and_a_missing_job(tmp_path, make_llm, tiny_chat_model, s3_server: S3Server):  # noqa: F811
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=100_000)
    prefix = str(tmp_path / "out")
    run_shards(make_llm(), job_dir(prefix, sub.job_id), sub.messages)
    bucket = s3_server.make_bucket()
    proc = _results(sub.job_id, "--output", prefix, "-o", f"s3://{bucket}/a.jsonl")  # env: moto
    assert proc.returncode == 0, proc.stderr
    body = s3_server.client().get_object(Bucket=bucket, Key="a.jsonl")["Body"].read()
    assert body == (Path(prefix) / sub.job_id / "output.jsonl").read_bytes()

    missing = _results("job-nope", "--output", prefix)
    assert missing.returncode == 1 and "kvbatch results:" in missing.stderr


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_status_and_finalize_say_where_the_answers_are(tmp_path, make_llm, tiny_chat_model):  # noqa: F811
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=100_000)
    prefix = str(tmp_path / "out")
    job = job_dir(prefix, sub.job_id)
    running = _cli("status", sub.job_id, "--output", prefix)
    assert running.returncode == 0 and f"folder         {job.uri}" in running.stdout
    assert "answers" not in running.stdout
    run_shards(make_llm(), job, sub.messages)

    table = _cli("finalize", sub.job_id, "--output", prefix)  # the same table as status
    assert table.returncode == 0, table.stderr
    output_file = job.join("output.jsonl").uri
    assert f"answers        {output_file}" in table.stdout
    assert f"kvbatch results {sub.job_id} --output {prefix} -o FILE" in table.stdout
    as_json = json.loads(_cli("finalize", sub.job_id, "--output", prefix, "--json").stdout)
    assert as_json["status"] == "completed" and as_json["output_file"] == output_file
    status = json.loads(_cli("status", sub.job_id, "--output", prefix, "--json").stdout)
    assert status["output_file"] == output_file and status["job_dir"] == job.uri
    assert Path(output_file).is_file()


def test_watch_rewrites_its_block_on_a_terminal(tmp_path, tiny_chat_model):
    """Under a pseudo-terminal `--watch` moves the cursor back over its block and clears it
    before each refresh, instead of printing the block again below."""
    import os
    import pty

    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=100_000)
    argv = ["status", sub.job_id, "--output", str(tmp_path / "out"), "--watch"]
    argv += ["--interval", "0.05", "--max-refreshes", "3"]
    pid, fd = pty.fork()
    if pid == 0:  # the child: kvbatch with the terminal as its stdout
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "kvbatch.cli", *argv])
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, code = os.waitpid(pid, 0)
    out = b"".join(chunks).decode()
    assert os.waitstatus_to_exitcode(code) == 0, out
    lines = len([r for r in out.split("\x1b[")[0].splitlines() if r.strip()])
    assert out.count(f"\x1b[{lines}F\x1b[J") == 2, out  # two refreshes after the first block
    assert out.count("job            " + sub.job_id) == 3


@pytest.mark.parametrize("command", ["results", "finalize", "status", "cancel"])
@pytest.mark.parametrize(
    ("job_id", "prefix", "says"),
    [
        ("job-1", "{tmp}/nothing-here", "no job 'job-1' under {tmp}/nothing-here"),
        ("job-1", "{tmp}/a-file", "no job 'job-1' under {tmp}/a-file"),
        ("../job-1", "{tmp}", "job id '../job-1' cannot name a job"),
        ("..", "{tmp}", "job id '..' cannot name a job"),
        ("job-1", "ftp://host/jobs", "unsupported scheme ftp://"),
    ],
)
def test_a_job_that_is_not_there_is_one_line_saying_so(tmp_path, command, job_id, prefix, says):
    """`results` and `finalize` said 'cannot read X/job-1/job.json: Not a directory' where
    `status` and `cancel` said 'no job'; a job id with '../' never reaches outside the prefix."""
    (tmp_path / "a-file").write_text("not a folder")
    prefix, says = prefix.format(tmp=tmp_path), says.format(tmp=tmp_path)
    status, out, err = run_main([command, job_id, "--output", prefix])
    assert (status, out) == (1, "")
    assert err.startswith(f"kvbatch {command}: "), err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_results_refuse_to_write_into_the_jobs_own_folder(tmp_path, make_llm, tiny_chat_model):  # noqa: F811
    """`-o PREFIX/JOB/job.json` overwrote the job's manifest (and `kvbatch status` then failed
    with a bare "Extra data"): any target inside the job's folder is refused, through a
    symlink or '..' too, and the folder stays as it was."""
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=100_000)
    prefix = str(tmp_path / "out")
    folder = tmp_path / "out" / sub.job_id
    run_shards(make_llm(), job_dir(prefix, sub.job_id), sub.messages)
    (tmp_path / "link").symlink_to(folder)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    for target in (
        folder / "job.json",
        folder / "batch.json",
        folder / "shards" / "shard-00000.jsonl",
        folder / "new.jsonl",
        tmp_path / "link" / "job.json",
        tmp_path / "out" / "x" / ".." / sub.job_id / "output.jsonl",
    ):
        code, out, err = run_main(["results", sub.job_id, "--output", prefix, "-o", str(target)])
        assert (code, out) == (1, ""), (target, err)
        assert f"inside the job's own folder {folder}" in err, err
    after = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == before
    assert run_main(["status", sub.job_id, "--output", prefix])[0] == 0
    beside = tmp_path / "out" / f"{sub.job_id}.answers.jsonl"  # same prefix, not inside
    code, _, err = run_main(["results", sub.job_id, "--output", prefix, "-o", str(beside)])
    assert code == 0, err
    assert beside.read_bytes() == (folder / "output.jsonl").read_bytes()


def test_results_refuse_an_s3_target_inside_the_job(
    tmp_path,
    make_llm,  # noqa: F811
    tiny_chat_model,
    s3_server: S3Server,
):
    from kvbatch.jobs.distributed.submit import prepare_job
    from tests.jobs.distributed.test_submit import BLOCK_SIZE, MAX_MODEL_LEN, write_jsonl

    bucket = s3_server.make_bucket()
    prefix = f"s3://{bucket}/jobs"
    src = write_jsonl(tmp_path / "in.jsonl", rag_lines())
    sub = prepare_job(str(src), prefix, str(tiny_chat_model), block_size=BLOCK_SIZE,
                      max_model_len=MAX_MODEL_LEN, shard_tokens=100_000)  # fmt: skip
    run_shards(make_llm(), job_dir(prefix, sub.job_id), sub.messages)
    key = f"jobs/{sub.job_id}/job.json"
    manifest = s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    code, out, err = run_main(
        ["results", sub.job_id, "--output", prefix, "-o", f"{prefix}/{key[5:]}"]
    )  # noqa: E501
    assert (code, out) == (1, "") and "inside the job's own folder" in err, err
    assert s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read() == manifest
    code, _, err = run_main(
        ["results", sub.job_id, "--output", prefix, "-o", f"{prefix}/{sub.job_id}-answers.jsonl"]
    )  # noqa: E501
    assert code == 0, err


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"id": "a"}\n{"id": "b"}\n', "is not valid JSON (Extra data"),
        (b"[]\n", "is not a job manifest"),
    ],
)
def test_a_damaged_manifest_is_named(tmp_path, tiny_chat_model, content, says):
    """A job.json holding answers (or anything else) makes status, results, finalize and
    cancel say which file is damaged, not a bare "Extra data: line 2 column 1"."""
    sub = prepare(tmp_path, tiny_chat_model, rag_lines(), shard_tokens=100_000)
    prefix = str(tmp_path / "out")
    manifest = tmp_path / "out" / sub.job_id / "job.json"
    manifest.write_bytes(content)
    for command in ("status", "results", "finalize", "cancel"):
        code, out, err = run_main([command, sub.job_id, "--output", prefix])
        assert (code, out) == (1, ""), (command, err)
        assert f"{manifest} {says}" in err and err.startswith(f"kvbatch {command}: "), err

"""`kvbatch run` used as a hostile user would: lines that break parsers, two runs on one
output, `--resume` onto answers that are not its own, outputs that are not plain files, links
planted at the partial file's name, Ctrl-C and a full disk. Each ends in a clear message or
in every line accounted for exactly once; none in a traceback or a clobbered file."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbatch.jobs.distributed.submit import prepare_job
from kvbatch.jobs.local.digest_index import hex_key, id_number
from kvbatch.jobs.local.output_lock import LEASE_SECONDS, OutputBusy, output_lock
from kvbatch.jobs.local.partial import PartialError, PartialOutput
from kvbatch.jobs.local.run import (
    JobError,
    RunOptions,
    job_identity,
    line_digest,
    resolve_paths,
    run_job,
)
from kvbatch.jobs.storage import open_storage
from tests.jobs.local.test_run import (
    answer_text,
    chat,
    completion,
    llm,  # noqa: F401  (the module's engine fixture)
    plant_partial,
    read_jsonl,
    write_jsonl,
)
from tests.jobs.local.test_run_cli import ENGINE_FLAGS, kvbatch, one_clear_message, run_cli
from tests.s3_server import S3Server


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBATCH_CACHE", str(tmp_path / "cache"))


def errors_by_line(path: Path) -> dict[int, dict]:
    return {e["error"]["line"]: e for e in read_jsonl(path)}


# -- 1. one line never kills the job -------------------------------------------------------------

POISON = [
    b"[" * 100_000,
    rb'{"custom_id": "\ud800", "method": "POST", "url": "/v1/completions", '
    rb'"body": {"prompt": "hi", "max_tokens": 2}}',
    rb'{"custom_id": "m", "method": "POST", "url": "/v1/completions", '
    rb'"body": {"model": "\udc00", "prompt": "hi", "max_tokens": 2}}',
    rb'{"custom_id": "k", "\ud800": 1, "method": "POST", "url": "/v1/completions", '
    rb'"body": {"prompt": "hi", "max_tokens": 2}}',
    rb'{"custom_id": "s", "method": "POST", "url": "/v1/completions", '
    rb'"body": {"prompt": "hi", "stop": ["\ud800"], "max_tokens": 2}}',
    rb'{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", '
    rb'"body": {"messages": [{"role": "user", "content": "x\udfff"}], "max_tokens": 2}}',
]
D1, D2 = "d1" * 16, "d2" * 16  # line digests (32 hex digits)
NAMED = {2: "'custom_id'", 3: "'body.model'", 4: "a key of the line", 5: "'body.stop[0]'"}
NAMED[6] = "'body.messages[0].content'"


def test_a_poison_line_is_one_error_record_and_the_job_completes(llm, tmp_path: Path):  # noqa: F811
    lines = [completion("good-0", "hello there", max_tokens=2), *POISON]
    lines.append(chat("good-1", "how are you", max_tokens=2))
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="unused", output=str(tmp_path / "out.jsonl"))
    record = run_job(opts, llm=llm)

    assert (record.completed, record.failed) == (2, len(POISON))
    assert [a["custom_id"] for a in read_jsonl(tmp_path / "out.jsonl")] == ["good-0", "good-1"]
    errors = errors_by_line(tmp_path / "out.errors.jsonl")
    assert sorted(errors) == list(range(2, 2 + len(POISON)))
    assert errors[2]["error"]["code"] == "invalid_json"
    assert "nest too deeply" in errors[2]["error"]["message"]
    for n in range(3, 2 + len(POISON)):
        assert errors[n]["error"]["code"] == "invalid_encoding", errors[n]
        assert NAMED[n - 1] in errors[n]["error"]["message"], errors[n]
    assert errors[3]["custom_id"] == "kvbatch-line-3"  # the surrogate id itself is never echoed
    assert errors[4]["custom_id"] == "m"
    batch = json.loads((tmp_path / "out.batch.json").read_text())
    assert batch["request_counts"] == {"total": 2 + len(POISON), "completed": 2, "failed": 6}
    # Nothing of the run is left behind (no partial file, no spilled prompts).
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in.jsonl",
        "out.batch.json",
        "out.errors.jsonl",
        "out.jsonl",
    ]


def test_submit_turns_poison_lines_into_error_records(tiny_chat_model: Path, tmp_path: Path):
    lines = [completion("good-0", "hello there", max_tokens=2), *POISON]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    job = prepare_job(str(source), str(tmp_path / "jobs"), str(tiny_chat_model), job_id="j1")
    assert (job.num_requests, job.num_invalid) == (1, len(POISON))
    errors = read_jsonl(tmp_path / "jobs" / "j1" / "validation_errors.jsonl")
    assert [e["error"]["line"] for e in errors] == list(range(2, 2 + len(POISON)))


# -- 2. one run per output -----------------------------------------------------------------------


def test_a_second_run_on_a_locked_output_refuses_naming_the_holder(tmp_path: Path):
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi", max_tokens=2)])
    output = tmp_path / "out.jsonl"
    # Another process holds the output, as a running `kvbatch run` does.
    script = (
        "import sys, time\n"
        "from kvbatch.jobs.local.output_lock import output_lock\n"
        f"with output_lock({str(output)!r}, 'other.jsonl'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(120)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run_cli("run", str(source), "-o", str(output), "--model", "unused")
        line = one_clear_message(result, str(output), f"pid {holder.pid}", "other.jsonl")
        assert "in use" in line
        assert not output.exists()
    finally:
        holder.kill()
        holder.wait()
    # The kernel released the dead holder's lock: the output is free again.
    with output_lock(str(output), str(source)):
        pass


def test_a_run_losing_the_race_names_the_new_holder_not_a_killed_one(tmp_path: Path):
    """The window between a run taking the lock and writing its record: the loser must not
    name the killed run whose record is still in the file, and waits for the new one."""
    output = tmp_path / "out.jsonl"
    lock = tmp_path / ".out.jsonl.lock"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "input": "old.jsonl", "since": 0.0}
    lock.write_text(json.dumps(stale) + " " * 64)  # longer than the new record
    # The new holder locks at once and writes its record (as output_lock does) 0.3 s later.
    script = (
        "import fcntl, json, os, socket, sys, time\n"
        f"fd = os.open({str(lock)!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(0.3)\n"
        "record = json.dumps({'host': socket.gethostname(), 'pid': os.getpid(),\n"
        "                     'input': 'new.jsonl', 'since': time.time()}).encode()\n"
        "os.pwrite(fd, record, 0)\n"
        "os.ftruncate(fd, len(record))\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputBusy) as busy:
            with output_lock(str(output), "mine.jsonl"):
                pass
        message = str(busy.value)
        assert f"pid {holder.pid}" in message and "new.jsonl" in message
        assert "old.jsonl" not in message
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_two_runs_at_once_write_each_answer_once(tiny_chat_model: Path, tmp_path: Path):
    lines = [completion(f"r{i}", f"number {i} is", max_tokens=4) for i in range(200)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    args = ["run", str(source), "-o", str(output), "--model", str(tiny_chat_model), *ENGINE_FLAGS]
    procs = [
        kvbatch(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes in ([0, 0], [0, 1]), results
    if codes == [0, 1]:
        loser = results[[p.returncode for p in procs].index(1)]
        assert "in use by kvbatch run pid" in loser[1]
    out = read_jsonl(output)
    assert [a["custom_id"] for a in out] == [f"r{i}" for i in range(200)]
    batch = json.loads((tmp_path / "out.batch.json").read_text())
    assert batch["request_counts"]["total"] == 200


def test_an_s3_output_is_leased(llm, s3_server: S3Server, tmp_path: Path):  # noqa: F811
    bucket = s3_server.make_bucket()
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi", max_tokens=2)])
    output = f"s3://{bucket}/run/out.jsonl"
    opts = RunOptions(input=str(source), model="unused", output=output)
    with output_lock(output, "other.jsonl"):
        with pytest.raises(JobError, match=r"in use by kvbatch run pid \d+ .*other\.jsonl"):
            run_job(opts, llm=llm)
    assert not open_storage(output).exists()
    # A lease its holder stopped renewing (killed) is taken over.
    stale = {"host": "gone", "pid": 1, "input": "x", "since": 0.0, "expires_at": time.time() - 1}
    open_storage(output + ".lock").write_bytes(json.dumps(stale).encode())
    record = run_job(opts, llm=llm)
    assert record.completed == 1
    assert not open_storage(output + ".lock").exists()  # released at the end
    assert LEASE_SECONDS > 10


# -- 3. --resume uses only answers to this input and this model ----------------------------------


def test_resume_onto_another_jobs_answers_answers_this_job(llm, tmp_path: Path):  # noqa: F811
    job_a = [completion(f"r{i}", f"apples {i}", max_tokens=4) for i in range(4)]
    job_b = [completion(f"r{i}", f"zebras {i} run", max_tokens=4) for i in range(4)]
    a_in, b_in = write_jsonl(tmp_path / "a.jsonl", job_a), write_jsonl(tmp_path / "b.jsonl", job_b)
    fresh = RunOptions(input=str(b_in), model="unused", output=str(tmp_path / "fresh.jsonl"))
    run_job(fresh, llm=llm)
    expected = [answer_text(a) for a in read_jsonl(tmp_path / "fresh.jsonl")]
    a_opts = RunOptions(input=str(a_in), model="unused", output=str(tmp_path / "out.jsonl"))
    run_job(a_opts, llm=llm)
    a_answers = read_jsonl(tmp_path / "out.jsonl")
    for a in a_answers:
        a["response"]["body"]["choices"][0]["text"] = "ANSWER OF JOB A"
    # Job A was interrupted with three answers committed; job B is resumed onto its output.
    plant_partial(a_opts, job_a, a_answers[:3])
    b_opts = RunOptions(
        input=str(b_in), model="unused", output=str(tmp_path / "out.jsonl"), resume=True
    )
    record = run_job(b_opts, llm=llm)
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [answer_text(a) for a in out] == expected
    assert record.completed == 4


def test_resume_answers_an_edited_line_again(llm, tmp_path: Path):  # noqa: F811
    lines = [completion(f"r{i}", f"pears {i}", max_tokens=4) for i in range(4)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="unused", output=str(tmp_path / "out.jsonl"))
    run_job(opts, llm=llm)
    answers = read_jsonl(tmp_path / "out.jsonl")
    plant_partial(opts, lines, answers)  # every answer committed, then the kill
    lines[2] = completion("r2", "a completely different question", max_tokens=4)
    write_jsonl(source, lines)
    edited_alone = write_jsonl(tmp_path / "edited.jsonl", [lines[2]])
    run_job(RunOptions(input=str(edited_alone), model="unused"), llm=llm)
    expected = answer_text(read_jsonl(tmp_path / "edited.output.jsonl")[0])

    opts.resume = True
    run_job(opts, llm=llm)
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [a["custom_id"] for a in out] == ["r0", "r1", "r2", "r3"]
    assert answer_text(out[2]) == expected
    assert [answer_text(a) for i, a in enumerate(out) if i != 2] == [
        answer_text(a) for i, a in enumerate(answers) if i != 2
    ]


def test_resume_places_answers_where_their_lines_are_now_and_drops_a_stray(
    llm,  # noqa: F811
    tmp_path: Path,
):
    """Answers are kept by the bytes of their line, not by where it was: a line inserted above
    them and a line moved to the end put them in the new order. A committed answer that names
    another custom_id than the line its digest is of (a hand-edited partial) is not used: that
    line is answered again, and the stray answer is not written."""
    lines = [completion(f"r{i}", f"figs {i}", max_tokens=4) for i in range(5)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="unused", output=str(tmp_path / "out.jsonl"))
    run_job(opts, llm=llm)
    reference = {a["custom_id"]: a for a in read_jsonl(tmp_path / "out.jsonl")}
    planted = {}
    for cid in ("r1", "r3"):
        planted[cid] = json.loads(json.dumps(reference[cid]))
        planted[cid]["response"]["body"]["choices"][0]["text"] = f"PLANTED {cid}"
    path = plant_partial(opts, lines, [planted["r1"], planted["r3"]])
    stray = json.loads(json.dumps(reference["r4"]))
    stray["response"]["body"]["choices"][0]["text"] = "STRAY"
    partial = PartialOutput(path)
    partial.recover(job_identity(opts))
    partial.add(stray, line_digest(json.dumps(lines[2]).encode()))  # r4's answer, r2's bytes
    partial.close()

    now = [completion("new", "dates", max_tokens=4), lines[0], lines[1], lines[2], lines[4],
           lines[3]]  # fmt: skip
    write_jsonl(source, now)
    opts.resume = True
    record = run_job(opts, llm=llm)
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [a["custom_id"] for a in out] == ["new", "r0", "r1", "r2", "r4", "r3"]
    texts = {a["custom_id"]: answer_text(a) for a in out}
    assert texts["r1"] == "PLANTED r1" and texts["r3"] == "PLANTED r3"
    assert texts["r2"] == answer_text(reference["r2"]) and texts["r4"] == answer_text(
        reference["r4"]
    )
    assert "STRAY" not in (tmp_path / "out.jsonl").read_text()
    assert (record.completed, record.failed) == (6, 0)


def test_resume_with_another_model_refuses(llm, tmp_path: Path):  # noqa: F811
    lines = [completion("r0", "plums", max_tokens=2)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    opts = RunOptions(input=str(source), model="model-a", output=str(tmp_path / "out.jsonl"))
    plant_partial(opts, lines, [])
    opts.model, opts.resume = "model-b", True
    with pytest.raises(JobError, match="'model-a'.*without --resume"):
        run_job(opts, llm=llm)
    assert not (tmp_path / "out.jsonl").exists()


# -- 5. no file is clobbered ---------------------------------------------------------------------


def test_output_equal_to_the_input_is_refused(tmp_path: Path):
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi")])
    before = source.read_bytes()
    result = run_cli("run", str(source), "-o", str(tmp_path / "." / "in.jsonl"), "--model", "x")
    one_clear_message(result, "is the input file")
    assert source.read_bytes() == before


def test_a_link_planted_at_the_partial_files_name_is_never_followed(llm, tmp_path: Path):  # noqa: F811
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "keep").write_bytes(b"keep")
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi", max_tokens=2)])
    opts = RunOptions(input=str(source), model="unused", output=str(tmp_path / "out.jsonl"))
    partial = resolve_paths(opts).partial
    partial.symlink_to(victim)
    partial.with_name(partial.name + ".tokens").symlink_to(victim_dir)
    lock = tmp_path / ".out.jsonl.lock"
    lock.symlink_to(tmp_path / "lock-victim")

    with pytest.raises(JobError, match="is a link"):
        run_job(opts, llm=llm)  # the lock file is a link: refused, nothing followed
    assert not (tmp_path / "lock-victim").exists()
    lock.unlink()
    opts.resume = True
    with pytest.raises(JobError, match="never followed"):
        run_job(opts, llm=llm)
    opts.resume = False
    assert run_job(opts, llm=llm).completed == 1
    assert victim.read_bytes() == b"precious\n"
    assert (victim_dir / "keep").read_bytes() == b"keep"


def test_an_output_that_is_not_a_regular_file_is_refused(tmp_path: Path):
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi")])
    node = tmp_path / "null"
    if os.geteuid() == 0:
        os.mknod(node, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
    else:
        os.mkfifo(node)
    kind = node.stat().st_mode
    result = run_cli("run", str(source), "-o", str(node), "--model", "x")
    one_clear_message(result, str(node), "not a regular file")
    assert node.stat().st_mode == kind


@pytest.mark.parametrize(
    ("errors", "clash"),
    [("out.jsonl", "the answers (-o)"), ("./out.batch.json", "batch.json")],
)
def test_one_file_for_two_of_the_jobs_files_is_refused(tmp_path: Path, errors, clash):
    """`--errors` naming the output once left a completed job whose answers were replaced by
    its (empty) error file."""
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi")])
    opts = RunOptions(
        input=str(source),
        model="not loaded: refused before",
        output=str(tmp_path / "out.jsonl"),
        errors=str(tmp_path / errors),
    )
    with pytest.raises(JobError, match=f"would hold both .*{re.escape(clash)}.*different files"):
        run_job(opts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("output", ["{tmp}/new-dir/", "{tmp}/.", "{tmp}/sub/..", "s3://bkt/pre/"])
def test_an_output_that_names_a_folder_is_refused_before_any_work(tmp_path: Path, output):
    """`-o new-dir/` once ran the whole job, then failed to write, leaving `.new-dir.partial`
    behind; `/x/y/../` wrote '....partial' inside y."""
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi")])
    output = output.format(tmp=tmp_path)
    for flags in ({"output": output}, {"output": str(tmp_path / "o.jsonl"), "errors": output}):
        opts = RunOptions(input=str(source), model="not loaded: refused before", **flags)
        with pytest.raises(JobError, match=r"names a folder, not a file: name a file in it"):
            run_job(opts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_work_dir_that_is_a_file_is_refused_before_any_work(tmp_path: Path):
    """It failed after the model loaded with 'cannot write in.jsonl: File exists'."""
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi")])
    opts = RunOptions(
        input=str(source),
        model="not loaded",
        output=str(tmp_path / "o.jsonl"),
        work_dir=str(source),
    )
    with pytest.raises(JobError, match=r"--work-dir .* is a file, not a folder"):
        run_job(opts)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_file_uris_and_tilde_outputs_lock_and_keep_their_partial_beside_the_real_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """`-o file:///x/o.jsonl` failed to lock 'file:/x/.o.jsonl.lock'; `-o '~/o.jsonl'` kept its
    partial output in a folder literally named '~'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for output in (f"file://{tmp_path}/o.jsonl", "~/o.jsonl"):
        paths = resolve_paths(RunOptions(input="in.jsonl", model="x", output=output))
        assert paths.output == str(tmp_path / "o.jsonl")
        assert paths.partial == tmp_path / ".o.jsonl.partial"
        assert paths.errors == str(tmp_path / "o.errors.jsonl")


def test_stdin_to_stdout_runs_and_resume_without_answers_says_so(
    llm,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsysbinary: pytest.CaptureFixture,
    caplog: pytest.LogCaptureFixture,
):
    """`kvbatch run - -o -` was refused as "the input file would be replaced"; --resume with
    nothing to resume from ran everything without a word."""
    lines = [completion("a", "hi", max_tokens=2), b"{oops"]
    data = write_jsonl(tmp_path / "in.jsonl", lines).read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    opts = RunOptions(input="-", model="unused", output="-", resume=True)
    with caplog.at_level(logging.INFO, logger="kvbatch"):
        record = run_job(opts, llm=llm)
    assert (record.completed, record.failed) == (1, 1)
    out, err = capsysbinary.readouterr()
    assert [a["custom_id"] for a in read_jsonl(out)] == ["a"]
    assert b'"code": "invalid_json"' in err  # the error records go to stderr
    assert "--resume: no answers of an earlier run" in caplog.text


# -- 6. messages, never tracebacks ---------------------------------------------------------------


def test_an_unsupported_output_scheme_is_a_message(tmp_path: Path):
    source = write_jsonl(tmp_path / "in.jsonl", [completion("a", "hi")])
    result = run_cli("run", str(source), "-o", "ftp://host/out.jsonl", "--model", "x")
    one_clear_message(result, "unsupported scheme ftp://")


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_resume_finishes(tiny_chat_model: Path, tmp_path: Path):
    lines = [completion(f"r{i}", f"count {i} and", max_tokens=8) for i in range(300)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    args = ["run", str(source), "-o", str(output), "--model", str(tiny_chat_model)]
    args += [*ENGINE_FLAGS, "--window", "16"]
    partial = resolve_paths(RunOptions(input=str(source), model="", output=str(output))).partial
    proc = kvbatch(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.read_bytes().count(b"\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "--resume" in err.strip().splitlines()[-1]
    committed = len(
        {json.loads(raw)["record"]["custom_id"] for raw in partial.read_bytes().splitlines()[1:]}
    )
    assert committed >= 1

    result = run_cli(*args, "--resume", timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"resuming: {committed} requests already answered" in result.stderr
    assert [a["custom_id"] for a in read_jsonl(output)] == [f"r{i}" for i in range(300)]


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A 256 KiB tmpfs (root only): a disk that fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_a_full_disk_is_one_message_and_resume_finishes(
    tiny_chat_model: Path, tiny_disk: Path, tmp_path: Path
):
    lines = [completion(f"r{i}", f"count {i} and", max_tokens=4) for i in range(60)]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    filler = tiny_disk / "filler"
    filler.write_bytes(b"x" * (256 * 1024 - 16 * 1024))  # ~16 KiB left: not enough
    output = tiny_disk / "out.jsonl"
    args = ["run", str(source), "-o", str(output), "--model", str(tiny_chat_model)]
    args += [*ENGINE_FLAGS, "--work-dir", str(tmp_path / "work")]
    result = run_cli(*args, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvbatch run: cannot write the output {output}"), last
    assert "No space left on device" in last and "--resume" in last
    assert not output.exists()
    filler.unlink()
    result = run_cli(*args, "--resume", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "resuming: 60 requests already answered" in result.stderr
    assert len(read_jsonl(output)) == 60


# -- 7. finished answers are committed while a long request runs ---------------------------------


def test_finished_answers_are_committed_on_a_timer(tmp_path: Path):
    partial = PartialOutput(tmp_path / "p", flush_lines=64, flush_seconds=0.2)
    partial.reset({"model": "m"})
    partial.add({"custom_id": "short-1"}, D1)
    partial.add({"custom_id": "short-2"}, D2)
    # Nothing else finishes (a long request is still running): the timer commits them.
    deadline = time.monotonic() + 10
    while (tmp_path / "p").read_bytes().count(b"\n") < 3:
        assert time.monotonic() < deadline, "the finished answers were never committed"
        time.sleep(0.05)
    again = PartialOutput(tmp_path / "p")
    done = again.recover({"model": "m"})
    assert len(done) == 2
    assert done.get(hex_key(D1)) == id_number("short-1")
    assert done.get(hex_key(D2)) == id_number("short-2")
    again.close()
    partial.close()


def test_resume_from_a_torn_header_starts_over_and_a_damaged_or_odd_file_is_refused(
    tmp_path: Path,
):
    path = tmp_path / "p"
    path.write_bytes(b'{"kvbatch_partial": 1, "iden')  # killed while writing the header
    partial = PartialOutput(path)
    assert len(partial.recover({"model": "m"})) == 0
    partial.add({"custom_id": "a"}, D1)
    partial.close()
    with open(path, "ab") as f:
        f.write(b"not json\n")
    with pytest.raises(PartialError, match="damaged"):
        PartialOutput(path).recover({"model": "m"})
    path.unlink()
    os.mkfifo(path)  # a reader would block on it forever
    with pytest.raises(PartialError, match="never followed"):
        PartialOutput(path).recover({"model": "m"})

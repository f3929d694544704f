"""kvbatch.jobs.storage against real parts: the local file system, real pipes, and moto's S3 server
over HTTP (tests.s3_server)."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvbatch.jobs.storage import (
    AlreadyExists,
    LocalStorage,
    StorageError,
    open_storage,
    validate_key_part,
)
from tests.s3_server import S3Server, s3_server  # noqa: F401

MiB = 1024 * 1024


def _race(storage_for_thread, n: int = 8) -> list[bool]:
    """Run write_if_absent from n threads released together; return each thread's result."""
    barrier = threading.Barrier(n)
    results: list[bool] = [False] * n

    def run(i: int) -> None:
        barrier.wait()
        results[i] = storage_for_thread(i).write_if_absent(f"writer {i}\n".encode() * 1000)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# -- keys and URIs


@pytest.mark.parametrize("good", ["batch_abc123", "run-2024-05-01", "a.b=c", "0007.jsonl"])
def test_validate_key_part_accepts_safe_names(good):
    assert validate_key_part(good) == good


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("..", "not allowed"),
        (".", "not allowed"),
        ("", "not allowed"),
        ("a/b", "'/'"),
        ("job 1", "' '"),
        ("jöb", "'ö'"),
        ("x" * 256, "longer than 255"),
    ],
)
def test_validate_key_part_names_the_bad_part(bad, why):
    with pytest.raises(ValueError, match="key part") as info:
        validate_key_part(bad)
    assert why in str(info.value)
    assert repr(bad[:40]) in str(info.value)


@pytest.mark.parametrize("bad", ["..", "a/../b", "/etc/passwd", "a//b", "a/", "x y", "a\\b"])
def test_join_rejects_unsafe_parts_and_names_them(tmp_path, bad):
    with pytest.raises(ValueError, match="key part") as info:
        open_storage(str(tmp_path)).join("jobs", bad)
    assert repr(bad) in str(info.value)


def test_join_nests_parts_with_slashes():
    assert (
        open_storage("out").join("job-1", "shards/0001.jsonl").uri == "out/job-1/shards/0001.jsonl"
    )
    assert open_storage("s3://bkt").join("a", "b/c").uri == "s3://bkt/a/b/c"
    assert open_storage("s3://bkt/pre/").join("a").uri == "s3://bkt/pre/a"


def test_open_storage_picks_by_uri(tmp_path):
    assert type(open_storage("-")).__name__ == "StdioStorage"
    assert type(open_storage("s3://bkt/k")).__name__ == "S3Storage"
    local = open_storage(f"file://{tmp_path}/x.jsonl")
    assert isinstance(local, LocalStorage) and local.path == tmp_path / "x.jsonl"
    with pytest.raises(StorageError, match="unsupported scheme gs://"):
        open_storage("gs://bkt/k")
    with pytest.raises(StorageError, match="empty"):
        open_storage("")
    with pytest.raises(StorageError, match="not a bucket name"):
        open_storage("s3://")
    for typo in ("s3:/bkt/k", "s3:bkt", "file:x"):  # never a local folder named "s3:"
        with pytest.raises(StorageError, match="nor a plain path"):
            open_storage(typo)
    assert isinstance(open_storage("./a:b"), LocalStorage)


# -- local files


def test_local_read_streams_lines(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b'{"a": 1}\n{"b": 2}\nlast')
    src = open_storage(str(tmp_path / "in.jsonl"))
    src.check_readable()
    assert src.exists()
    with src.open_read() as f:
        assert list(f) == [b'{"a": 1}\n', b'{"b": 2}\n', b"last"]


def test_local_missing_input_fails_with_its_path(tmp_path):
    src = open_storage(str(tmp_path / "nope.jsonl"))
    assert not src.exists()
    for call in (src.check_readable, src.open_read):
        with pytest.raises(StorageError, match="nope.jsonl not found"):
            call()
    with pytest.raises(StorageError, match="is a directory"):
        open_storage(str(tmp_path)).check_readable()


def test_local_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    out = open_storage(str(tmp_path / "sub" / "out.jsonl"))
    out.write_bytes(b"old\n")
    with pytest.raises(RuntimeError, match="crash"):
        with out.open_write() as f:
            f.write(b"half of the new cont")
            raise RuntimeError("crash mid-write")
    assert out.path.read_bytes() == b"old\n"  # the old file, untouched
    with out.open_write() as f:
        f.write(b"new\n")
        assert out.path.read_bytes() == b"old\n"  # nothing visible before the block exits
    assert out.path.read_bytes() == b"new\n"
    assert sorted(p.name for p in out.path.parent.iterdir()) == ["out.jsonl"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_local_crash_before_first_write_leaves_nothing(tmp_path):
    out = open_storage(str(tmp_path / "out.jsonl"))
    with pytest.raises(RuntimeError):
        with out.open_write() as f:
            f.write(b"partial")
            raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


def test_local_write_if_absent_first_writer_wins(tmp_path):
    out = open_storage(str(tmp_path / "shard.jsonl"))
    assert out.write_if_absent(b"first") is True
    assert out.write_if_absent(b"second") is False
    assert out.path.read_bytes() == b"first"
    with pytest.raises(AlreadyExists, match="shard.jsonl already exists"):
        with out.open_write(if_absent=True) as f:
            f.write(b"third")
    assert out.path.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["shard.jsonl"]


def test_local_write_if_absent_race_has_one_winner(tmp_path):
    path = tmp_path / "shard.jsonl"
    results = _race(lambda i: LocalStorage(str(path)))
    assert results.count(True) == 1
    winner = results.index(True)
    assert path.read_bytes() == f"writer {winner}\n".encode() * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["shard.jsonl"]


def test_local_append_adds_to_the_end(tmp_path):
    out = open_storage(str(tmp_path / "new" / "out.jsonl"))
    with out.open_append() as f:
        f.write(b"batch 1\n")
    with out.open_append() as f:
        f.write(b"batch 2\n")
    assert out.path.read_bytes() == b"batch 1\nbatch 2\n"


def test_local_unwritable_output_fails_before_writing(tmp_path):
    (tmp_path / "blocker").write_text("a file where a folder should be")
    out = open_storage(str(tmp_path / "blocker" / "job" / "out.jsonl"))
    for call in (out.check_writable, lambda: out.open_write().__enter__()):
        with pytest.raises(StorageError, match="blocker is a file, not a folder") as info:
            call()
        assert "out.jsonl" in str(info.value)
    with pytest.raises(StorageError, match="is a directory"):
        open_storage(str(tmp_path)).check_writable()
    ok = open_storage(str(tmp_path / "fresh" / "out.jsonl"))
    ok.check_writable()
    assert list((tmp_path / "fresh").iterdir()) == []  # the probe is gone


def test_local_list_is_recursive_sorted_and_skips_temp_files(tmp_path):
    root = open_storage(str(tmp_path / "job"))
    assert list(root.list()) == []  # no folder yet
    for name in ("shards/0002.jsonl", "shards/0001.jsonl", "batch.json"):
        root.join(name).write_bytes(b"x")
    with root.join("shards/0003.jsonl").open_write() as f:
        f.write(b"x")  # a writer mid-way: its temp file is not listed
        assert list(root.list()) == ["batch.json", "shards/0001.jsonl", "shards/0002.jsonl"]
    assert list(root.list("shards/")) == [
        "shards/0001.jsonl",
        "shards/0002.jsonl",
        "shards/0003.jsonl",
    ]
    with pytest.raises(ValueError, match="list prefix"):
        list(root.list("../"))


# -- stdin / stdout


def test_stdio_in_process(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"line 1\nline 2\n")))
    out_bytes = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out_bytes))
    std = open_storage("-")
    std.check_readable()
    std.check_writable()
    assert list(std.open_read()) == [b"line 1\n", b"line 2\n"]
    with std.open_write() as f:
        f.write(b"answer 1\n")
    std.write_bytes(b"answer 2\n")
    assert out_bytes.getvalue() == b"answer 1\nanswer 2\n"
    for call, what in [
        (lambda: std.write_if_absent(b"x"), "write-once"),
        (std.open_append, "resume"),
        (lambda: std.join("a"), "folder"),
        (std.list, "listing"),
    ]:
        with pytest.raises(StorageError, match=what):
            call()


def test_stdio_through_real_pipes():
    code = (
        "from kvbatch.jobs.storage import open_storage\n"
        "src, dst = open_storage('-'), open_storage('-')\n"
        "src.check_readable()\n"
        "with dst.open_write() as out:\n"
        "    for line in src.open_read():\n"
        "        out.write(line.upper())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=b"a\nb\n",
        capture_output=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=60,
        check=True,
    )
    assert done.stdout == b"A\nB\n"


# -- S3 (moto's server over HTTP)


@pytest.fixture
def bucket(s3_server: S3Server) -> str:  # noqa: F811
    return s3_server.make_bucket()


@pytest.fixture
def fresh_client():
    """A client built from this test's environment, and none left behind for the next test."""
    from kvbatch.jobs.storage.s3 import reset_client

    reset_client()
    yield
    reset_client()


def test_s3_client_uses_aws_endpoint_url_and_standard_retries(s3_server):  # noqa: F811
    from kvbatch.jobs.storage import s3

    s3.reset_client()
    clients: list[object] = []
    threads = [threading.Thread(target=lambda: clients.append(s3.client())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(c) for c in clients}) == 1  # one client per process, even when raced
    client = clients[0]
    assert client.meta.endpoint_url == s3_server.endpoint
    assert client.meta.config.retries == {"mode": "standard", "total_max_attempts": 5}


def test_s3_read_streams_lines(s3_server, bucket):  # noqa: F811
    lines = [
        f'{{"custom_id": "r{i}", "pad": "{"x" * (i % 50)}"}}\n'.encode() for i in range(40_000)
    ]
    data = b"".join(lines) + b"no newline at the end"
    s3_server.client().put_object(Bucket=bucket, Key="in/job.jsonl", Body=data)
    src = open_storage(f"s3://{bucket}/in/job.jsonl")
    src.check_readable()
    assert src.exists()
    with src.open_read() as f:
        assert next(f) == lines[0]  # streams: the first line comes before the rest is read
        rest = list(f)
    assert rest == lines[1:] + [b"no newline at the end"]  # lines across 1 MiB buffer edges


def test_s3_write_small_object_with_one_put(s3_server, bucket):  # noqa: F811
    out = open_storage(f"s3://{bucket}/out/batch.json")
    out.check_writable()
    assert s3_server.client().list_objects_v2(Bucket=bucket).get("Contents") is None  # probe gone
    out.write_bytes(b'{"status": "completed"}')
    got = s3_server.client().get_object(Bucket=bucket, Key="out/batch.json")
    assert got["Body"].read() == b'{"status": "completed"}'
    assert "-" not in got["ETag"]


def test_s3_open_write_uses_multipart_for_big_outputs(s3_server, bucket):  # noqa: F811
    from kvbatch.jobs.storage.s3 import MIN_PART_SIZE, S3Storage

    out = S3Storage(f"s3://{bucket}/out/output.jsonl", part_size=MIN_PART_SIZE)
    chunk = bytes(range(256)) * 4096  # 1 MiB
    with out.open_write() as f:
        for _ in range(11):
            f.write(chunk)
    got = s3_server.client().get_object(Bucket=bucket, Key="out/output.jsonl")
    assert got["ETag"].strip('"').endswith("-3")  # 5 MiB + 5 MiB + 1 MiB
    assert got["Body"].read() == chunk * 11
    with pytest.raises(ValueError, match="minimum"):
        S3Storage(f"s3://{bucket}/x", part_size=MiB)


def test_s3_write_if_absent_first_writer_wins(s3_server, bucket):  # noqa: F811
    out = open_storage(f"s3://{bucket}/shards/0001.jsonl")
    assert out.write_if_absent(b"first") is True
    assert out.write_if_absent(b"second") is False
    body = s3_server.client().get_object(Bucket=bucket, Key="shards/0001.jsonl")["Body"]
    assert body.read() == b"first"
    results = _race(lambda i: open_storage(f"s3://{bucket}/shards/0002.jsonl"), n=4)
    assert results.count(True) == 1


def test_s3_conditional_multipart_loses_cleanly(s3_server, bucket):  # noqa: F811
    from kvbatch.jobs.storage.s3 import MIN_PART_SIZE, S3Storage

    out = S3Storage(f"s3://{bucket}/shards/big.jsonl", part_size=MIN_PART_SIZE)
    assert out.write_if_absent(b"winner")
    with pytest.raises(AlreadyExists, match="big.jsonl already exists"):
        with out.open_write(if_absent=True) as f:
            f.write(b"y" * (MIN_PART_SIZE + 10))
    client = s3_server.client()
    assert client.get_object(Bucket=bucket, Key="shards/big.jsonl")["Body"].read() == b"winner"
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads") is None


def test_s3_exception_aborts_the_upload(s3_server, bucket):  # noqa: F811
    from kvbatch.jobs.storage.s3 import MIN_PART_SIZE, S3Storage

    out = S3Storage(f"s3://{bucket}/out/output.jsonl", part_size=MIN_PART_SIZE)
    client = s3_server.client()
    with pytest.raises(RuntimeError, match="engine died"):
        with out.open_write() as f:
            f.write(b"z" * (MIN_PART_SIZE + 1))  # one part is already uploaded
            assert len(client.list_multipart_uploads(Bucket=bucket)["Uploads"]) == 1
            raise RuntimeError("engine died")
    assert not out.exists()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads") is None
    with pytest.raises(RuntimeError):
        with out.open_write() as f:
            f.write(b"small")
            raise RuntimeError("before any part")
    assert not out.exists()


def test_s3_missing_bucket_and_key_fail_clearly(s3_server, bucket):  # noqa: F811
    missing_key = open_storage(f"s3://{bucket}/in/nope.jsonl")
    for call in (missing_key.check_readable, missing_key.open_read):
        with pytest.raises(StorageError, match=f"s3://{bucket}/in/nope.jsonl not found"):
            call()
    assert not missing_key.exists()
    no_bucket = open_storage("s3://no-such-bucket-kvbatch/in.jsonl")
    for call in (no_bucket.check_readable, no_bucket.open_read, no_bucket.check_writable):
        with pytest.raises(StorageError, match="bucket 'no-such-bucket-kvbatch' does not exist"):
            call()
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-kvbatch' does not exist"):
        list(open_storage("s3://no-such-bucket-kvbatch/out").list())
    with pytest.raises(StorageError, match="names a bucket or folder"):
        open_storage(f"s3://{bucket}").open_read()
    with pytest.raises(StorageError, match="resume appends to a local output"):
        missing_key.open_append()


def test_s3_list_under_a_prefix(s3_server, bucket):  # noqa: F811
    root = open_storage(f"s3://{bucket}/jobs/job-1")
    for name in ("shards/0002.jsonl", "shards/0001.jsonl", "batch.json"):
        root.join(name).write_bytes(b"x")
    open_storage(f"s3://{bucket}/jobs/job-10/batch.json").write_bytes(b"x")  # not under job-1/
    assert list(root.list()) == ["batch.json", "shards/0001.jsonl", "shards/0002.jsonl"]
    assert list(root.list("shards/")) == ["shards/0001.jsonl", "shards/0002.jsonl"]
    assert list(open_storage(f"s3://{bucket}").list("jobs/job-10")) == ["jobs/job-10/batch.json"]


def test_s3_without_credentials_says_so(s3_server, bucket, monkeypatch, fresh_client):  # noqa: F811
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(StorageError, match="no AWS credentials found") as info:
        open_storage(f"s3://{bucket}/in.jsonl").check_readable()
    assert "AWS_ACCESS_KEY_ID" in str(info.value)


def test_s3_unreachable_endpoint_says_so(s3_server, bucket, monkeypatch, fresh_client):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # no backoff: connection refused is final
    with pytest.raises(StorageError, match=f"cannot reach S3 endpoint http://127.0.0.1:{port}"):
        open_storage(f"s3://{bucket}/in.jsonl").check_readable()


@pytest.mark.parametrize(
    ("endpoint", "shown"),
    [
        ("http://user:pw@127.0.0.1:{port}", "http://user:***@127.0.0.1:{port}"),
        ("http://token@127.0.0.1:{port}", "http://***@127.0.0.1:{port}"),
        ("http://user:pw@[::1:{port}", "http://user:***@[::1:{port}"),  # no parser accepts it
    ],
)
def test_s3_endpoint_credentials_are_masked(
    s3_server,  # noqa: F811
    bucket,
    monkeypatch,
    fresh_client,
    endpoint,
    shown,
):
    import traceback

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.format(port=port))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StorageError) as info:
        open_storage(f"s3://{bucket}/in.jsonl").check_readable()
    printed = "".join(traceback.format_exception(info.value))  # what a worker's log shows
    assert shown.format(port=port) in str(info.value)
    assert "pw" not in printed and "token" not in printed, printed


def test_delete_tree_removes_a_folder_and_what_is_under_it(tmp_path, s3_server):  # noqa: F811
    """Local: the folders go too; S3: every object under the prefix, and none beside it."""
    local = LocalStorage(str(tmp_path / "run"))
    local.join("embed", "shards", "a.jsonl").write_bytes(b"x")
    local.join("kept.json").write_bytes(b"{}")
    local.join("embed").delete_tree()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["kept.json"]
    bucket = s3_server.make_bucket()
    run = open_storage(f"s3://{bucket}/run")
    for key in ("embed/shards/a.jsonl", "embed/input.jsonl", "embedded.json"):
        run.join(key).write_bytes(b"x")
    run.join("embed").delete_tree()
    assert list(run.list()) == ["embedded.json"]

"""A fleet that shares nothing but the broker and the bucket: documents, table and run folder
all on moto's S3 server; a generation worker and an embedding worker (real `kvbatch worker`
processes on a real redis-server), each in an empty working directory of its own; `kvbatch
index SPEC --broker URL` from a third. The generation worker is SIGKILLed in the middle of a
shard and another started: every chunk is in the table once, a search finds a document's
passage, and a second run with nothing changed writes nothing. Slow (workers import torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvbatch.cli import main
from kvbatch.index.distributed import model_queue
from kvbatch.index.search import search
from kvbatch.index.spec import load_spec
from kvbatch.index.table import connect, open_table
from tests.index.test_distributed import TEXTS, _logs
from tests.processes import stop_processes
from tests.redis_server import redis_server  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _worker(tmp: Path, broker: str, model: Path, env: dict, name: str) -> subprocess.Popen:
    """A worker in an empty folder of its own: it can reach the run folder only through S3."""
    cwd = tmp / name
    cwd.mkdir()
    log = (tmp / f"{name}.log").open("w")
    args = [sys.executable, "-m", "kvbatch.cli", "worker", "--model", str(model), "--broker",
            broker, "--queue", model_queue(str(model)), "--device", "cpu", "--max-num-seqs",
            "4", "--metrics-port", "0"]  # fmt: skip
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_documents_table_and_run_folder_on_s3_with_a_worker_killed(
    tmp_path,
    redis_server,  # noqa: F811
    s3_server,
    tiny_chat_model,
    minilm,
    monkeypatch,
):
    bucket = s3_server.make_bucket()
    s3 = s3_server.client()
    for name, text in TEXTS.items():
        s3.put_object(Bucket=bucket, Key=f"docs/{name}", Body=text.encode())
    here = tmp_path / "indexer"
    here.mkdir()
    (here / "index.toml").write_text(f"""
[source]
path = "s3://{bucket}/docs"
[chunking]
size = 48
overlap = 8
[models]
generation = "{tiny_chat_model}"
embedding = "{minilm}"
[stages.context]
max_tokens = 6
[stages.embed]
[output]
uri = "s3://{bucket}/index"
""")  # no output.runs: beside the table, s3://<bucket>/index.runs
    spec = load_spec(here / "index.toml")
    assert spec.output.runs == f"s3://{bucket}/index.runs"
    env = {k: v for k, v in os.environ.items() if k != "KVBATCH_BROKER_URL"}
    env.update(KVBATCH_VISIBILITY_TIMEOUT="3", KVBATCH_RUNNING_HEARTBEAT="0.5")
    gen_env = {**env, "KVBATCH_STEP_DELAY": "0.3"}
    procs = [
        _worker(tmp_path, redis_server.url, tiny_chat_model, gen_env, "generation-0"),
        _worker(tmp_path, redis_server.url, minilm, env, "embedding-0"),
    ]
    monkeypatch.chdir(here)
    argv = ["index", "index.toml", "--broker", redis_server.url, "--shard-tokens", "150",
            "--report", str(tmp_path / "report.json")]  # fmt: skip
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(code=main(argv)), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 240
        running: list[str] = []
        while not running:
            assert time.monotonic() < deadline, _logs(tmp_path)
            listed = s3.list_objects_v2(Bucket=bucket, Prefix="index.runs/").get("Contents", [])
            running = [o["Key"] for o in listed if "/generate/running/" in o["Key"]]
            time.sleep(0.1)
        shard = Path(running[0]).stem
        job_prefix = running[0].split("/running/")[0]
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        done = s3.list_objects_v2(Bucket=bucket, Prefix=f"{job_prefix}/results/{shard}")
        assert not done.get("Contents"), "the shard finished before the kill"
        procs.append(_worker(tmp_path, redis_server.url, tiny_chat_model, gen_env, "generation-1"))
        thread.join(timeout=400)
        assert not thread.is_alive(), _logs(tmp_path)
        assert result["code"] == 0, _logs(tmp_path)
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["errors"] == [] and report["chunks"] >= len(TEXTS)
        # nothing of the run on the local disk of any of the three
        for folder in (here, tmp_path / "generation-0", tmp_path / "embedding-0"):
            assert sorted(p.name for p in folder.iterdir()) in ([], ["index.toml"])
        keys = {
            o["Key"]
            for o in s3.list_objects_v2(Bucket=bucket, Prefix="index.runs/").get("Contents", [])
        }
        run = f"index.runs/{report['run_id']}"
        assert {f"{run}/chunks.parquet", f"{run}/manifest.json"} <= keys
        assert not any(k.startswith(f"{run}/generate/") for k in keys), "stage jobs cleaned up"
        # every chunk once, and a passage found
        table = open_table(connect(spec.output.uri), spec.output.table)
        ids = table.to_arrow().column("chunk_id").to_pylist()
        assert len(ids) == len(set(ids)) == report["chunks"]
        hit = search(spec.output.uri, "Fresnel lens of glass prisms", k=1)[0]
        assert hit.document_id == "lamps.txt"
        # a second run with nothing changed writes nothing and sends nothing
        again: dict = {}
        thread = threading.Thread(target=lambda: again.update(code=main(argv)), daemon=True)
        thread.start()
        thread.join(timeout=200)
        assert again["code"] == 0
        second = json.loads((tmp_path / "report.json").read_text())
        assert second["wrote"] is False and second["documents_parsed"] == 0
    finally:
        stop_processes(procs)

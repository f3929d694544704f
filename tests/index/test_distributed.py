"""`kvbatch index --broker` end to end: real redis-server, one real `kvbatch worker` per model
(the tiny chat model writing contexts, the real all-MiniLM-L6-v2 embedding), the generation
worker SIGKILLed in the middle of a shard and a new one started. The table must hold every
chunk once, with the rows the one-machine run writes. Slow (workers import torch)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvbatch.cli import main
from kvbatch.index.distributed import model_queue
from kvbatch.index.pipeline import run_index
from tests.index.indexing import WatchedModels, index_spec, table_rows
from tests.processes import stop_processes
from tests.redis_server import redis_server  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
TEXTS = {
    "tides.txt": "Tides rise and fall twice a day. The Moon pulls the near side of the sea. "
    "Spring tides come when the Sun and the Moon line up. Neap tides are the weakest.",
    "reefs.txt": "Coral reefs are built by tiny polyps over thousands of years. Warm water "
    "makes corals expel their algae and bleach. Reefs shelter a quarter of sea life.",
    "lamps.txt": "A lighthouse guides ships at night with a bright light. Fresnel designed a "
    "lens of glass prisms that bends one lamp into a narrow beam seen far out at sea.",
}


def _worker(tmp: Path, broker: str, model: Path, env: dict, name: str) -> subprocess.Popen:
    log = (tmp / f"{name}.log").open("w")
    args = [sys.executable, "-m", "kvbatch.cli", "worker", "--model", str(model), "--broker",
            broker, "--queue", model_queue(str(model)), "--device", "cpu", "--max-num-seqs",
            "4", "--metrics-port", "0"]  # fmt: skip
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, str, str], float]:
    """/metrics, parsed by prometheus_client: (name, stage or kind, what) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            first = sample.labels.get("stage") or sample.labels.get("kind", "")
            out[(sample.name, first, sample.labels.get("what", ""))] = sample.value
    return out


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in tmp.glob("*.log"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_worker_killed_mid_shard_leaves_every_chunk_once(
    tmp_path,
    redis_server,  # noqa: F811
    tiny_chat_model,
    minilm,
):
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in TEXTS.items():
        (docs / name).write_text(text)
    (tmp_path / "local").mkdir()
    (tmp_path / "workers").mkdir()
    local = index_spec(tmp_path / "local", docs, tiny_chat_model, minilm)
    spec = index_spec(tmp_path / "workers", docs, tiny_chat_model, minilm)
    env = dict(os.environ)
    env.pop("KVBATCH_BROKER_URL", None)
    # Quick redelivery of the killed worker's shard: its heartbeat goes stale after 1.5 s and
    # Redis hands the unacknowledged message out again after 3 s. Slowed generation steps
    # leave the shard running when the kill comes.
    env.update(KVBATCH_VISIBILITY_TIMEOUT="3", KVBATCH_RUNNING_HEARTBEAT="0.5")
    gen_env = {**env, "KVBATCH_STEP_DELAY": "0.3"}
    procs = [
        _worker(tmp_path, redis_server.url, tiny_chat_model, gen_env, "generation-0"),
        _worker(tmp_path, redis_server.url, minilm, env, "embedding-0"),
    ]
    result: dict = {}

    def index() -> None:
        argv = ["index", str(tmp_path / "workers" / "index.toml"), "--broker",
                redis_server.url, "--shard-tokens", "150", "--report",
                str(tmp_path / "report.json"), "--metrics-port", str(port)]  # fmt: skip
        result["code"] = main(argv)

    port = _free_port()
    thread = threading.Thread(target=index, daemon=True)
    try:
        thread.start()
        # The one-machine run meanwhile (the workers are still starting up).
        expected = run_index(local, llm_factory=WatchedModels())
        runs = Path(spec.output.runs)
        deadline = time.monotonic() + 120
        running: list[Path] = []
        while not running:
            assert time.monotonic() < deadline, _logs(tmp_path)
            running = list(runs.glob("run-*/generate/running/*.json"))
            time.sleep(0.05)
        shard = running[0].stem
        job = running[0].parents[1]
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        assert not (job / "results" / f"{shard}.jsonl").exists(), "the shard finished first"
        procs.append(_worker(tmp_path, redis_server.url, tiny_chat_model, gen_env, "generation-1"))
        thread.join(timeout=240)
        assert not thread.is_alive(), _logs(tmp_path)
    finally:
        stop_processes(procs)
    assert result["code"] == 0, _logs(tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["errors"] == [] and report["chunks"] == expected.chunks
    assert report["prefill"]["ideal"] > 0
    rows, want = table_rows(spec), table_rows(local)
    assert len({r["chunk_id"] for r in rows}) == len(rows)  # each chunk once
    assert [(r["chunk_id"], r["text"], r["context"]) for r in rows] == [
        (r["chunk_id"], r["text"], r["context"]) for r in want
    ]
    for got, exp in zip(rows, want, strict=True):
        assert got["embedding"] == pytest.approx(exp["embedding"], abs=1e-4)
        assert got["run_id"] == report["run_id"]
    # the metrics the command served, per stage, as Prometheus reads them
    samples = _scrape(port)
    for stage in ("generate", "embed"):
        assert samples[("kvbatch_index_stage_progress", stage, "requests_done")] == len(rows)
        assert samples[("kvbatch_index_stage_progress", stage, "shards_done")] >= 1
        assert samples[("kvbatch_index_documents_total", stage, "")] >= len(TEXTS)
    assert samples[("kvbatch_index_prefill_tokens_total", "ideal", "")] > 0
    # the same run folder as on one machine: the same plan, so the same run id
    assert report["run_id"] == expected.run_id
    run = runs / report["run_id"]
    assert sorted(p.name for p in run.iterdir()) == ["chunks.parquet", "manifest.json"]


def test_an_unreachable_broker_stops_the_run_before_any_work(tmp_path, minilm, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "tides.txt").write_text(TEXTS["tides.txt"])
    spec = index_spec(tmp_path, docs, None, minilm)
    argv = ["index", str(tmp_path / "index.toml"), "--broker", "redis://:s3cret@127.0.0.1:1/0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot reach the broker redis://:***@127.0.0.1:1/0" in err and "s3cret" not in err
    assert not Path(spec.output.runs).exists() and not Path(spec.output.uri).exists()

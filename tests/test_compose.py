"""compose.yaml, the Dockerfile and deploy/: the stack is checked without Docker.

Every command the stack runs is run (or parsed) here, outside its container: the kvbatch
commands through kvbatch's own argument parser and `--help`, the bucket one-liner and the
moto healthcheck against moto's server, the redis command and its healthcheck against a real
redis-server. The file itself is validated against the Compose Specification's JSON schema
(tests/data/compose-spec.json, from compose-spec/compose-spec's schema/compose-spec.json) with
`jsonschema`: no container engine, nothing installed on the system. Where a `docker-compose`
is already on PATH, its own `config` check runs too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import tomllib
import yaml

from tests.redis_server import redis_executable

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
COMPOSE_SCHEMA = Path(__file__).resolve().parent / "data" / "compose-spec.json"
KVBATCH_IMAGE = "kvbatch:latest"
# Commands that compose runs but kvbatch does not have yet; each must sit in a profile that
# `docker compose up` leaves out by default. Delete an entry when its command lands.
PENDING_COMMANDS: set[str] = set()
# Host paths the user supplies (the model folder) or that land with pending work.
USER_PATHS = {"./models"}

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value):
    """Compose's `${VAR:-default}`, with the defaults (the environment is ignored)."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(COMPOSE, encoding="utf-8") as f:
        return _interpolate(yaml.safe_load(f))


def _services(compose: dict) -> dict:
    return compose["services"]


def _kvbatch_services(compose: dict) -> dict:
    """Services that run our image with its `kvbatch` entrypoint."""
    return {
        name: s
        for name, s in _services(compose).items()
        if s.get("image") == KVBATCH_IMAGE and "entrypoint" not in s
    }


def _default_profile(service: dict) -> bool:
    return not service.get("profiles")


def _env(service: dict) -> dict:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "environment as a mapping, so anchors merge"
    return {k: str(v) for k, v in env.items()}


class _Parsed(Exception):
    def __init__(self, ns: argparse.Namespace):
        self.ns = ns


def parse_kvbatch(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """`argv` through kvbatch's own parser (kvbatch.cli.main), stopping before it runs."""
    import kvbatch.cli

    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    with monkeypatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        try:
            kvbatch.cli.main(list(argv))
        except _Parsed as parsed:
            return parsed.ns
    raise AssertionError(f"kvbatch {argv} ran without parsing its arguments")


def _known_command(name: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parse_kvbatch([name, "--help"], monkeypatch)
    except SystemExit as e:
        return e.code == 0  # --help exits 0; an unknown command exits 2
    return True


# --- the file -------------------------------------------------------------------------------


def _schema_errors(document: dict) -> list[str]:
    """Where `document` breaks the Compose Specification's schema (draft 7), one line each."""
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in sorted(validator.iter_errors(document), key=lambda e: list(e.absolute_path))
    ]


def test_compose_file_follows_the_compose_spec_schema(compose):
    errors = _schema_errors(compose)
    assert not errors, "compose.yaml breaks the Compose Specification:\n" + "\n".join(errors)


def test_compose_spec_schema_catches_mistakes(compose):
    """The schema check can fail: a misspelt key and a wrong type are both reported."""
    broken = json.loads(json.dumps(compose))
    broken["services"]["worker"]["comand"] = broken["services"]["worker"].pop("command")
    broken["services"]["redis"]["volumes"] = "redis-data:/data"  # a list
    errors = _schema_errors(broken)
    assert any("services/worker" in e and "comand" in e for e in errors), errors
    assert any("services/redis/volumes" in e for e in errors), errors


def test_every_service_has_an_image(compose):
    for name, service in _services(compose).items():
        assert service.get("image") or service.get("build"), f"{name}: no image or build"
        if service.get("image") == KVBATCH_IMAGE:
            assert service.get("build"), f"{name}: builds our image, so it can start first"


def test_default_profile_is_what_works_today(compose):
    default = {n for n, s in _services(compose).items() if _default_profile(s)}
    assert default == {"redis", "moto", "bucket", "worker"}
    assert _services(compose)["submit"]["profiles"] == ["example"]
    assert _services(compose)["beat"]["profiles"] == ["scheduled", "index"]
    for name in ("prometheus", "grafana"):
        assert _services(compose)[name]["profiles"] == ["observability"]


def test_redis_never_evicts_and_has_a_healthcheck(compose):
    redis = _services(compose)["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_worker_reserves_a_gpu_and_mounts_the_model(compose):
    worker = _services(compose)["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    mounts = {v.split(":")[1]: v for v in worker["volumes"]}
    assert "/models" in mounts and mounts["/models"].endswith(":ro")
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["depends_on"]["bucket"]["condition"] == "service_completed_successfully"
    env = _env(worker)
    assert env["AWS_ENDPOINT_URL"] == "http://moto:5000"
    assert env["AWS_ACCESS_KEY_ID"] == env["AWS_SECRET_ACCESS_KEY"] == "testing"
    assert "9400" in [str(p) for p in worker["expose"]]


def test_bind_mounts_exist(compose):
    for name, service in _services(compose).items():
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0]
            if source.startswith(".") and source not in USER_PATHS:
                assert (ROOT / source).exists(), f"{name}: {source} is missing"


# --- the commands it runs -------------------------------------------------------------------


def test_kvbatch_commands_are_valid_invocations(compose, monkeypatch):
    from kvbatch.worker.app import broker_url

    checked = set()
    for name, service in _kvbatch_services(compose).items():
        argv = [str(a) for a in service["command"]]
        if not _known_command(argv[0], monkeypatch):
            assert argv[0] in PENDING_COMMANDS, f"{name}: kvbatch has no command {argv[0]!r}"
            assert not _default_profile(service), f"{name}: pending, so keep it in a profile"
            continue
        ns = parse_kvbatch(argv, monkeypatch)
        assert ns.command == argv[0]
        broker = ns.broker or _env(service).get("KVBATCH_BROKER_URL")
        assert broker_url(broker) == "redis://redis:6379/0"
        if getattr(ns, "model", None):
            assert ns.model.startswith("/models/"), f"{name}: the model is on the volume"
        checked.add(argv[0])
    assert {"worker", "submit", "beat", "index-worker"} <= checked
    worker = parse_kvbatch(_services(compose)["worker"]["command"], monkeypatch)
    assert worker.device == "cuda"
    assert worker.kv_cache_memory_fraction == 0.90  # KVBATCH_KV_CACHE_MEMORY_FRACTION's default
    assert worker.kv_cache_dtype == "auto"  # KVBATCH_KV_CACHE_DTYPE's default


def test_beat_state_is_on_a_volume(compose, monkeypatch):
    """Beat's state file survives a restart of its container: on a named volume, which the
    image's /state (owned by the non-root user) seeds."""
    beat = _services(compose)["beat"]
    ns = parse_kvbatch(beat["command"], monkeypatch)
    state_dir = str(Path(ns.state).parent)
    named = {v.split(":")[1]: v.split(":")[0] for v in beat["volumes"]}
    assert state_dir in named, f"{ns.state} is not on a volume"
    assert named[state_dir] in compose["volumes"], "a named volume, not a bind mount"
    assert not named[state_dir].startswith(".")
    assert f"mkdir {state_dir}" in (ROOT / "Dockerfile").read_text()


def test_redis_keeps_the_queue_across_restarts(compose):
    command = _services(compose)["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    mounts = {v.split(":")[1] for v in _services(compose)["redis"]["volumes"]}
    assert "/data" in mounts


def test_submit_example_input_is_mounted(compose, monkeypatch):
    submit = _services(compose)["submit"]
    ns = parse_kvbatch(submit["command"], monkeypatch)
    mounts = dict(v.split(":")[:2][::-1] for v in submit["volumes"])
    inside = Path(ns.input)
    host = ROOT / mounts[str(inside.parent)] / inside.name
    assert host.is_file(), f"{ns.input} maps to {host}, which is missing"
    assert ns.output.startswith("s3://kvbatch/")  # the bucket the init service creates


@pytest.mark.slow
@pytest.mark.parametrize("command", ["worker", "submit", "finalize"])
def test_kvbatch_commands_start(command):
    """The commands compose (and its comments) run start in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"kvbatch {command}" in proc.stdout


def test_bucket_init_runs_against_moto(compose, s3_server):
    """The bucket service's one-liner, twice (a restart of the stack runs it again)."""
    bucket = _services(compose)["bucket"]
    assert bucket["entrypoint"] == ["python", "-c"]
    assert _env(bucket)["AWS_ENDPOINT_URL"] == "http://moto:5000"
    env = {**os.environ, **_env(bucket), "AWS_ENDPOINT_URL": s3_server.endpoint}
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", *bucket["command"]],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
    names = [b["Name"] for b in s3_server.client().list_buckets()["Buckets"]]
    assert "kvbatch" in names


def test_moto_healthcheck_runs_against_moto(compose, s3_server):
    moto = _services(compose)["moto"]
    test = moto["healthcheck"]["test"]
    assert test[0] == "CMD" and "http://localhost:5000/" in test[-1]
    argv = [sys.executable if a == "python" else a for a in test[1:]]
    argv[-1] = argv[-1].replace("http://localhost:5000", s3_server.endpoint)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_redis_command_and_healthcheck(compose, tmp_path):
    """redis's command (noeviction, AOF) and healthcheck on a local redis-server."""
    redis = _services(compose)["redis"]
    assert redis["command"][0] == "redis-server"
    assert redis["healthcheck"]["test"][1] == "redis-cli"
    port = str(_free_port())
    local = ["--port", port, "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    proc = subprocess.Popen(
        [redis_executable("redis-server"), *redis["command"][1:], *local],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cli = [redis_executable("redis-cli"), "-p", port]
    try:
        deadline = time.monotonic() + 10
        while True:
            ping = subprocess.run([*cli, "ping"], capture_output=True, text=True)
            if ping.stdout.strip() == "PONG":
                break
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not start"
            time.sleep(0.1)
        policy = subprocess.run(
            [*cli, "config", "get", "maxmemory-policy"], capture_output=True, text=True
        )
        assert policy.stdout.split() == ["maxmemory-policy", "noeviction"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# --- prometheus and grafana -----------------------------------------------------------------


def _mount_source(service: dict, target: str) -> Path:
    for volume in service["volumes"]:
        source, inside = volume.split(":")[:2]
        if inside == target:
            return ROOT / source
    raise AssertionError(f"nothing is mounted at {target}")


def test_prometheus_scrapes_the_workers(compose):
    prometheus = _services(compose)["prometheus"]
    path = _mount_source(prometheus, "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load(path.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    sd = jobs["kvbatch-worker"]["dns_sd_configs"][0]
    assert sd["names"] == ["worker"] and sd["port"] == 9400
    assert "worker" in _services(compose)


def test_grafana_is_provisioned(compose):
    grafana = _services(compose)["grafana"]
    provisioning = _mount_source(grafana, "/etc/grafana/provisioning")
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090:9090" in _services(compose)["prometheus"]["ports"]
    providers = yaml.safe_load((provisioning / "dashboards" / "kvbatch.yml").read_text())
    (provider,) = providers["providers"]
    dashboards_dir = provider["options"]["path"]
    host_dir = _mount_source(grafana, dashboards_dir)
    files = sorted(host_dir.glob("*.json"))
    assert files, f"no dashboards in {host_dir}"
    for file in files:
        dashboard = json.loads(file.read_text())
        assert dashboard["uid"] and dashboard["title"]
        assert dashboard["panels"], f"{file.name}: no panels"
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == source["uid"], panel["title"]
            assert all(t["expr"] for t in panel["targets"]), panel["title"]
    assert any(
        'up{job="kvbatch-worker"}' in t["expr"]
        for file in files
        for p in json.loads(file.read_text())["panels"]
        for t in p["targets"]
    ), "one panel shows whether Prometheus reaches the workers"


# --- the image ------------------------------------------------------------------------------


def test_dockerfile_installs_every_package():
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert 'ARG TORCH_SPEC="torch>=2.5"' in text
    assert 'ENTRYPOINT ["kvbatch"]' in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), "runs as a non-root user"
    copied = set(re.findall(r"^COPY (\S+) \./\1$", text, re.M))
    assert "kvbatch" in copied, "the image lacks the package folder kvbatch/"
    assert {"pyproject.toml", "README.md"} <= set(
        re.findall(r"^COPY (.+) \./$", text, re.M)[0].split()
    )
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "kvbatch" not in ignored and ".venv" in ignored


@pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="no docker-compose on PATH (the schema test covers the file; nothing is installed)",
)
def test_docker_compose_config():
    """Where docker-compose is already installed, it validates the file, every profile,
    without an engine."""
    profiles = sorted({p for s in yaml.safe_load(COMPOSE.read_text())["services"].values()
                       for p in s.get("profiles") or []})  # fmt: skip
    argv = ["docker-compose", "-f", str(COMPOSE)]
    for profile in profiles:
        argv += ["--profile", profile]
    proc = subprocess.run([*argv, "config", "-q"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# --- the nightly index (profile "index") ----------------------------------------------------


def test_the_index_profile_indexes_the_mounted_documents(compose, monkeypatch):
    """beat's schedule names an index spec at a path the index worker sees too; the spec's
    documents are mounted where it says; table and run folder are on the stack's bucket (no
    volume shared between the services); its stages' queues are consumed by a worker of the
    right model."""
    from kvbatch.index.distributed import model_queue
    from kvbatch.worker.schedule import IndexEntry, load_schedule

    services = _services(compose)
    beat = parse_kvbatch(services["beat"]["command"], monkeypatch)
    beat_mounts = dict(v.split(":")[:2][::-1] for v in services["beat"]["volumes"])
    schedule_host = ROOT / beat_mounts[str(Path(beat.schedule).parent)] / Path(beat.schedule).name
    (entry,) = load_schedule(schedule_host).jobs
    assert isinstance(entry, IndexEntry)
    spec_host = Path(entry.index)
    spec_inside = Path(beat.schedule).parent / spec_host.name
    index_worker = services["index-worker"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in index_worker["volumes"]}
    assert mounts[str(spec_inside.parent)] == "./deploy/schedules", "the spec at beat's path"
    spec = tomllib.loads(spec_host.read_text())
    assert (ROOT / mounts[spec["source"]["path"]]).is_dir()  # the default documents folder
    assert spec["output"]["uri"].startswith("s3://kvbatch/")  # the bucket the init makes
    assert spec["output"].get("runs", spec["output"]["uri"] + ".runs").startswith("s3://kvbatch/")
    # each stage's queue has a worker of that stage's model, which sees the run folder
    workers = {}
    for name in ("worker", "embed-worker"):
        ns = parse_kvbatch(services[name]["command"], monkeypatch)
        workers[ns.queue] = (ns.model, services[name])
    stages = {
        entry.generation_queue or model_queue(spec["models"]["generation"]): "generation",
        entry.embedding_queue or model_queue(spec["models"]["embedding"]): "embedding",
    }
    for queue, stage in stages.items():
        assert queue in workers, f"no worker consumes {queue} ({stage})"
        model, service = workers[queue]
        assert model == spec["models"][stage]
        assert _env(service)["AWS_ENDPOINT_URL"] == "http://moto:5000"
    named = [v for s in services.values() for v in s.get("volumes") or [] if v[0] not in "./$"]
    assert not [v for v in named if not v.startswith(("beat-state:", "redis-data:", "minio"))]

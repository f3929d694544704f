"""moto's S3 (and SQS, ...) server on a free local port, for tests that talk real HTTP.

Use it from a test module with `from tests.s3_server import s3_server  # noqa: F401`, or
import it into tests/conftest.py to share it. While the session runs, the AWS_* variables point
every boto3 client (and kvbatch.jobs.storage) at the server with dummy credentials; they are restored
afterwards.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

_UNSET_VARIABLES = (
    "AWS_ENDPOINT_URL_S3",  # would beat AWS_ENDPOINT_URL for S3
    "AWS_PROFILE",
    "AWS_MAX_ATTEMPTS",  # tests expect kvbatch.jobs.storage's default of 5
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    def client(self, service: str = "s3") -> Any:
        """A boto3 client for `service` on this server (for test setup and checks); made once,
        as making one costs ~0.5 s."""
        if service not in self._clients:
            import boto3

            session = boto3.session.Session()
            self._clients[service] = session.client(service, endpoint_url=self.endpoint)
        return self._clients[service]

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a unique name if none is given) and return its name."""
        name = name or f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A moto server for the whole session; see the module docstring."""
    from moto.server import ThreadedMotoServer

    from kvbatch.jobs.storage.s3 import reset_client

    werkzeug_log = logging.getLogger("werkzeug")  # one line per request otherwise
    werkzeug_level = werkzeug_log.level
    werkzeug_log.setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    no_file = str(tmp_path_factory.mktemp("aws") / "absent")  # hide ~/.aws config/credentials
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name in _UNSET_VARIABLES:
                mp.delenv(name, raising=False)
            for name, value in {
                "AWS_ENDPOINT_URL": f"http://{host}:{port}",
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": no_file,
                "AWS_SHARED_CREDENTIALS_FILE": no_file,
                "AWS_EC2_METADATA_DISABLED": "true",
            }.items():
                mp.setenv(name, value)
            reset_client()
            yield S3Server(endpoint=f"http://{host}:{port}")
    finally:
        reset_client()
        server.stop()
        werkzeug_log.setLevel(werkzeug_level)

"""The Celery app's settings for long GPU tasks, and JSON-only messages against a real Redis."""

from __future__ import annotations

import pickle

import pytest

from kvbatch.worker.app import TASK_NAME, BrokerError, broker_url, make_app
from tests.redis_server import redis_server  # noqa: F401


def test_settings_for_long_tasks():
    app = make_app("redis://127.0.0.1:1/0", visibility=1234)
    c = app.conf
    assert c.task_serializer == "json" and c.result_serializer == "json"
    assert list(c.accept_content) == ["json"] and list(c.result_accept_content) == ["json"]
    assert c.task_acks_late is True
    assert c.task_reject_on_worker_lost is True
    assert c.worker_prefetch_multiplier == 1
    assert c.worker_pool == "solo" and c.worker_concurrency == 1
    assert c.worker_cancel_long_running_tasks_on_connection_loss is True
    # Redis: the visibility timeout on both the broker and the result backend.
    assert c.broker_transport_options["visibility_timeout"] == 1234
    assert c.result_backend == "redis://127.0.0.1:1/0"
    assert c.result_backend_transport_options["visibility_timeout"] == 1234
    task = app.tasks[TASK_NAME]
    assert task.acks_late and task.reject_on_worker_lost


def test_default_visibility_timeout_is_hours(monkeypatch):
    monkeypatch.delenv("KVBATCH_VISIBILITY_TIMEOUT", raising=False)
    app = make_app("redis://127.0.0.1:1/0")
    assert app.conf.broker_transport_options["visibility_timeout"] >= 3600
    monkeypatch.setenv("KVBATCH_VISIBILITY_TIMEOUT", "10")
    options = make_app("redis://127.0.0.1:1/0").conf.broker_transport_options
    assert options["visibility_timeout"] == 10
    # expired unacknowledged messages are looked for well within the timeout
    assert options["unacked_restore_interval"] * options["unacked_restore_throttle"] <= 10
    monkeypatch.setenv("KVBATCH_VISIBILITY_TIMEOUT", "soon")
    with pytest.raises(BrokerError, match="whole seconds"):
        make_app("redis://127.0.0.1:1/0")


def test_sqs_transport_options(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("KVBATCH_SQS_QUEUE_URL", "https://sqs.eu-west-1.amazonaws.com/1/kvbatch")
    app = make_app("sqs://", visibility=7200)
    options = app.conf.broker_transport_options
    assert options["visibility_timeout"] == 7200
    assert options["region"] == "eu-west-1"
    assert options["predefined_queues"] == {
        "kvbatch": {"url": "https://sqs.eu-west-1.amazonaws.com/1/kvbatch"}
    }
    assert app.conf.task_ignore_result is True  # SQS has no result backend
    assert not app.conf.result_backend


def test_broker_url_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv("KVBATCH_BROKER_URL", raising=False)
    with pytest.raises(BrokerError, match="--broker"):
        broker_url(None)
    monkeypatch.setenv("KVBATCH_BROKER_URL", "rediss://queue:6380/0")
    assert broker_url(None) == "rediss://queue:6380/0"
    assert broker_url("redis://other/1") == "redis://other/1"
    with pytest.raises(BrokerError, match="expected one of"):
        broker_url("amqp://guest@localhost//")


def test_pickled_message_is_refused(redis_server):  # noqa: F811
    """A pickled message on the queue is never unpickled: kombu refuses its content type."""
    from kombu import Consumer, Queue
    from kombu.exceptions import ContentDisallowed

    app = make_app(redis_server.url)
    queue = Queue("kvbatch")
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        producer.publish(
            {"evil": True}, routing_key="kvbatch", serializer="pickle", declare=[queue]
        )
        producer.publish({"ok": True}, routing_key="kvbatch", serializer="json", declare=[queue])
    received, refused = [], []

    def on_decode_error(message, exc):
        refused.append(exc)
        message.ack()

    with app.connection_for_read() as conn:
        consumer = Consumer(
            conn,
            queues=[queue],
            accept=app.conf.accept_content,
            callbacks=[lambda body, message: (received.append(body), message.ack())],
            on_decode_error=on_decode_error,
        )
        with consumer:
            while len(received) + len(refused) < 2:
                conn.drain_events(timeout=5)
    assert received == [{"ok": True}]
    assert len(refused) == 1 and isinstance(refused[0], ContentDisallowed)
    # And the settings the worker decodes task bodies with refuse pickle outright.
    from kombu.serialization import loads

    with pytest.raises(ContentDisallowed):
        loads(
            pickle.dumps({"x": 1}),
            "application/x-python-serialize",
            "binary",
            accept=app.conf.accept_content,
        )


@pytest.mark.parametrize(
    "url",
    [
        "amqp://admin:PASSWORD@host//",  # an unsupported scheme
        "redis:/admin:PASSWORD@host:6379/0",  # a typo
        "redis//:PASSWORD@host",  # another
    ],
)
def test_a_bad_broker_url_is_named_without_its_password(url, monkeypatch):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", "worker", "--model", "unused", "--broker", url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "PASSWORD" not in result.stderr + result.stdout
    assert "***@host" in result.stderr and "expected one of" in result.stderr
    monkeypatch.setenv("KVBATCH_BROKER_URL", url)
    with pytest.raises(BrokerError) as caught:
        broker_url(None)
    assert "PASSWORD" not in str(caught.value)


MALFORMED = "redis://user:secret@[::1:1/9"  # kombu's sanitize_url raises on it


def test_a_malformed_broker_url_is_one_masked_line():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", "worker", "--model", "unused", "--broker", MALFORMED],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "secret" not in result.stderr + result.stdout and "Traceback" not in result.stderr
    assert "redis://user:***@[::1:1/9" in result.stderr and "malformed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_error_handler_masks_a_url_no_parser_accepts():
    """The handler that reports a broker error masks the URL by plain string work: kombu's
    sanitize_url raised inside it on this URL, and the message was lost."""
    from kvbatch.worker.cli import _broker_error, _where

    app = make_app("redis://user:secret@[::1:1/9")  # past broker_url's check
    assert _where(app) == "redis://user:***@[::1:1/9"
    error = ValueError(f"cannot connect to {MALFORMED}: Invalid IPv6 URL")
    assert (
        _broker_error(error, app) == "cannot connect to redis://user:***@[::1:1/9: Invalid IPv6 URL"
    )

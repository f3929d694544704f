"""`kvbatch resend` against a real redis-server, no workers: a job's shard messages are taken
off the queue by hand the way a worker takes them, and resend must find exactly the one that
the broker lost."""

from __future__ import annotations

import json

import pytest

from tests.redis_server import _free_port, redis_server  # noqa: F401
from tests.worker.test_distributed import _chat, _cli_in_process, _submit, _write_input


def _resend(*args: str) -> tuple[int, str, str]:
    return _cli_in_process("resend", *args)


def _resent(stdout: str) -> list[str]:
    """The shard ids printed after the summary line."""
    return stdout.splitlines()[1:]


@pytest.fixture
def job(tmp_path, redis_server, tiny_chat_model):  # noqa: F811
    """A submitted job of >= 4 shards, its messages waiting in the queue."""
    lines = [_chat(i, system=i % 3 == 0) for i in range(40)]
    input_path = _write_input(tmp_path / "input.jsonl", lines)
    output = tmp_path / "out"
    job_id = _submit(redis_server.url, input_path, output, tiny_chat_model, "--shard-tokens", "300")
    manifest = json.loads((output / job_id / "job.json").read_text())
    assert len(manifest["shards"]) >= 4
    return output, job_id, manifest


def test_resend_sends_only_the_shard_the_broker_lost(job, redis_server):  # noqa: F811
    import redis
    from kombu.utils.json import loads

    from kvbatch.broker.resend import held_shards
    from kvbatch.worker.app import make_app

    output, job_id, manifest = job
    ids = [s["shard_id"] for s in manifest["shards"]]
    client = redis.Redis.from_url(redis_server.url)
    assert client.llen("kvbatch") == len(ids)
    app = make_app(redis_server.url)
    # The oldest message popped and never recorded as delivered: what a BRPOP whose reply died
    # with the broker leaves behind. The message is gone from Redis.
    client.rpop("kvbatch")
    with app.connection_for_read() as conn:
        # The next one delivered by kombu itself and not acknowledged: it sits in `unacked`.
        delivered = conn.SimpleQueue("kvbatch", no_ack=False).get(timeout=5)
        assert delivered.decode()[1]["shard"]["shard_id"] == ids[1]
        assert client.hlen("unacked") == 1
        # The third one run to its end: its result written, its message acknowledged.
        client.rpop("kvbatch")
        (output / job_id / "results" / f"{ids[2]}.jsonl").parent.mkdir()
        (output / job_id / "results" / f"{ids[2]}.jsonl").write_text("{}\n")
        assert held_shards(app, "kvbatch", job_id) == set(ids) - {ids[0], ids[2]}

        args = [job_id, "--output", str(output), "--broker", redis_server.url, "--settle", "0.2"]
        code, out, err = _resend(*args)
        assert code == 0, err
        assert _resent(out) == [ids[0]]
        assert f"1 of {len(ids)} shards written; 1 lost by the broker sent again" in out
        # The message sent again is the shard's own, waiting at the head of the queue.
        payload = loads(client.lindex("kvbatch", 0))
        shard = conn.default_channel.message_to_python(payload).decode()[1]["shard"]
        assert shard == {"job_id": job_id, **{k: manifest["shards"][0][k] for k in
                         ("shard_id", "uri", "sha256")}}  # fmt: skip
        assert held_shards(app, "kvbatch", job_id) == set(ids) - {ids[2]}
        # Nothing is lost now: a second resend sends nothing.
        code, out, err = _resend(*args)
        assert code == 0, err
        assert _resent(out) == []
        # --unwritten sends every shard without a result, held or not.
        code, out, err = _resend(*args, "--unwritten")
        assert code == 0, err
        assert _resent(out) == [i for i in ids if i != ids[2]]
        assert client.llen("kvbatch") == 2 * len(ids) - 3
        delivered.ack()


def test_resend_explains_what_to_do_on_sqs_a_missing_job_and_no_broker(job):
    output, job_id, _manifest = job
    gone = f"redis://:hunter2@127.0.0.1:{_free_port()}/0"
    code, out, err = _resend(job_id, "--output", str(output), "--broker", gone, "--settle", "0")
    assert code == 1 and out == ""
    assert "cannot read or write the broker" in err and "hunter2" not in err
    sqs = "sqs://key:secret@127.0.0.1:9/"
    code, out, err = _resend(job_id, "--output", str(output), "--broker", sqs)
    assert code == 1 and out == ""
    assert "cannot be listed" in err and "--unwritten" in err and "secret" not in err
    code, _out, err = _resend("job-nope", "--output", str(output), "--broker", sqs)
    assert code == 1 and "no job 'job-nope'" in err
    code, _out, err = _resend("../escape", "--output", str(output), "--broker", sqs)
    assert code == 1 and "escape" in err

"""The run and worker flags beside the engine's (tests/kvbatch/test_engine_args.py): a bad
value stops the command at parsing, naming the flag. `--window -1` was a ValueError traceback
after the model loaded, `--metrics-port 70000` an OverflowError from socket.bind, `submit
--shard-tokens 0` a ValueError traceback once the broker was reached."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kvbatch.test_engine_args import run_main


@pytest.mark.parametrize(
    ("command", "flag", "value", "says"),
    [
        ("run", "--window", "-1", "must be >= 0"),
        ("run", "--metrics-port", "70000", "must be a port from 1 to 65535"),
        ("run", "--metrics-port", "-1", "must be a port from 1 to 65535"),
        ("run", "--metrics-port", "http", "expected a port number"),
        ("worker", "--metrics-port", "65536", "must be a port from 1 to 65535"),
        ("submit", "--shard-tokens", "0", "must be >= 1"),
        ("submit", "--block-size", "24", "must be a power of two"),
        ("submit", "--max-attempts", "0", "must be >= 1"),
        ("submit", "--max-model-len", "4k", "expected an integer"),
    ],
)
def test_a_bad_value_stops_at_parsing(tmp_path: Path, command, flag, value, says):
    missing = str(tmp_path / "nothing-here")
    broker = ["--broker", "redis://127.0.0.1:1/0"]  # never reached
    argv = {
        "run": ["run", missing],
        "worker": ["worker", *broker],
        "submit": ["submit", missing, "--output", str(tmp_path), *broker],
    }
    status, out, err = run_main([*argv[command], "--model", missing, flag, value])
    assert (status, out) == (2, "")
    assert f"argument {flag}: {says}" in err, err

"""Numbers from the environment are checked with a message that names the variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbatch.env_settings import SettingError, env_number
from kvbatch.jobs.storage import StorageError
from kvbatch.jobs.storage.s3 import MIN_PART_SIZE, S3Storage


def test_unset_gives_the_default_and_a_value_is_read(monkeypatch):
    monkeypatch.delenv("KVBATCH_TEST_N", raising=False)
    assert env_number("KVBATCH_TEST_N", 7) == 7
    monkeypatch.setenv("KVBATCH_TEST_N", " 12 ")
    assert env_number("KVBATCH_TEST_N", 7) == 12
    monkeypatch.setenv("KVBATCH_TEST_N", "0.25")
    assert env_number("KVBATCH_TEST_N", 0.0, kind=float) == 0.25


@pytest.mark.parametrize("raw", ["abc", "1.5", "nan", "-3"])
def test_a_bad_whole_number_is_named(monkeypatch, raw):
    monkeypatch.setenv("KVBATCH_TEST_N", raw)
    with pytest.raises(SettingError, match=r"KVBATCH_TEST_N="):
        env_number("KVBATCH_TEST_N", 1, minimum=1, unit="tries")


@pytest.mark.parametrize(
    "name, raw, says",
    [
        ("KVBATCH_S3_PART_SIZE", "8MB", "expected a whole number of bytes"),
        ("KVBATCH_S3_PART_SIZE", "1024", f"at least {MIN_PART_SIZE} bytes"),
        ("AWS_MAX_ATTEMPTS", "many", "expected a whole number of tries"),
        ("AWS_MAX_ATTEMPTS", "0", "at least 1 tries"),
    ],
)
def test_s3_settings_are_storage_errors(monkeypatch, name, raw, says):
    monkeypatch.setenv(name, raw)
    with pytest.raises(StorageError, match=says):
        S3Storage("s3://bucket/key")


def test_worker_names_a_bad_step_delay(tmp_path):
    """Checked at start-up, before the model loads: one line, exit 1, no traceback."""
    env = {**os.environ, "KVBATCH_STEP_DELAY": "soon"}
    result = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", "worker", "--model", str(tmp_path / "none"),
         "--broker", "redis://127.0.0.1:1/0"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    assert "KVBATCH_STEP_DELAY='soon': expected a number of seconds" in result.stderr
    assert "Traceback" not in result.stderr

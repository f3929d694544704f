"""`make test-fast` deselects the slow tiers: Triton-interpreter, real-model and distributed
tests (tests/conftest.py marks them), and `make test` still runs every test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = (ROOT / "Makefile").read_text()
FAST_MARKERS = re.search(r"^FAST_MARKERS := (.+)$", MAKEFILE, re.M).group(1)
SAMPLES = [
    "tests/kernels/test_rms_norm.py",  # interpreter
    "tests/engine/model/test_smollm2.py",  # real_model, by module
    "tests/kvbatch/test_fetch.py",  # real_model, by fixture (and plain tests beside them)
    "tests/worker/test_resend.py",  # distributed, by fixture (through the `job` fixture)
    "tests/engine/sched/test_scheduler.py",  # none: in the fast tier
]


def collected(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "::" in line]


@pytest.mark.slow
def test_the_fast_tier_leaves_out_the_slow_kinds_and_keeps_the_rest():
    every = collected(*SAMPLES)
    fast = collected("-m", FAST_MARKERS, *SAMPLES)
    assert not [t for t in fast if t.startswith(("tests/kernels/", "tests/engine/model/"))]
    assert "tests/kvbatch/test_fetch.py::test_smollm2_dir_is_a_complete_hf_folder" not in fast
    assert any(t.startswith("tests/kvbatch/test_fetch.py::") for t in fast)
    resend = [t for t in every if t.startswith("tests/worker/test_resend.py::")]
    assert resend and not set(resend) & set(fast)
    scheduler = [t for t in every if t.startswith("tests/engine/sched/")]
    assert scheduler and set(scheduler) <= set(fast)


def test_every_marker_the_fast_tier_names_is_declared():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    declared = {m.split(":")[0] for m in ini["markers"]}
    named = set(re.findall(r"not (\w+)", FAST_MARKERS))
    assert named == {"slow", "distributed", "interpreter", "real_model"} and named <= declared
    assert re.search(r"^test: .*\n\t\$\(BIN\)/pytest \$\(PYTEST_ARGS\)$", MAKEFILE, re.M)

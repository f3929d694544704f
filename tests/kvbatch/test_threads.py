"""`--threads` and its default: the cores this process may use, shared among the machine's
kvbatch workers and capped by the cores the machine's load leaves idle, so that a CPU run does
not oversubscribe. The default is read in fresh
interpreters whose affinity mask and environment the test sets (real processes, no mocks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.threads import LOCAL_WORKERS_ENV, default_threads, local_workers, share_of_cores

ROOT = Path(__file__).resolve().parents[2]
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

# prints (default_threads, torch's threads after apply_threads(None)) under a given affinity
_PROBE = """
import os, sys
cores = [int(c) for c in sys.argv[1].split(",")]
os.sched_setaffinity(0, cores)
from kvbatch.threads import apply_threads, default_threads
print(default_threads(), apply_threads(None))
import torch
print(torch.get_num_threads())
"""


def _probe(cores: list[int], **env: str) -> tuple[int, int, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    clean.pop(LOCAL_WORKERS_ENV, None)
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(map(str, cores))],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    default, applied, torch_threads = proc.stdout.split()
    return int(default), int(applied), int(torch_threads)


needs_affinity = pytest.mark.skipif(not CORES, reason="no sched_getaffinity on this platform")


@needs_affinity
def test_default_follows_the_affinity_mask_not_the_machine():
    assert _probe(CORES[:1]) == (1, 1, 1)


@needs_affinity
@pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores")
def test_default_shares_the_cores_among_local_workers():
    default, applied, torch_threads = _probe(CORES[:2])
    # 1 when the machine is busy; the load may change between the two reads of the default
    assert 1 <= default <= 2 and 1 <= applied == torch_threads <= 2
    assert _probe(CORES[:2], **{LOCAL_WORKERS_ENV: "2"}) == (1, 1, 1)
    # more workers than cores: still one thread each, never zero
    assert _probe(CORES[:2], **{LOCAL_WORKERS_ENV: "5"})[0] == 1


@pytest.mark.parametrize(
    ("usable", "workers", "machine", "load", "threads"),
    [
        (2, 1, 2, 0.0, 2),  # an idle 2-core machine: both cores
        (2, 2, 2, 0.0, 1),  # two workers share them
        (2, 5, 2, 0.0, 1),  # never zero
        (2, 1, 2, 1.2, 1),  # another process keeps a core busy
        (8, 1, 8, 6.4, 2),  # only the idle cores
        (8, 1, 8, 30.0, 1),  # an overloaded machine: one thread
        (4, 1, 16, 3.0, 4),  # a 4-core container on a big, mostly idle machine
        (16, 2, 16, 0.4, 8),
    ],
)
def test_share_of_cores(usable, workers, machine, load, threads):
    assert share_of_cores(usable, workers, machine, load) == threads


@needs_affinity
def test_omp_num_threads_set_by_the_user_wins():
    assert _probe(CORES[:1], OMP_NUM_THREADS="3") == (3, 3, 3)


def test_bad_worker_count_names_the_variable():
    assert local_workers({}) == 1
    assert local_workers({LOCAL_WORKERS_ENV: "4"}) == 4
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=LOCAL_WORKERS_ENV):
            default_threads({LOCAL_WORKERS_ENV: bad})


@pytest.mark.parametrize("command", ["generate", "run", "worker"])
def test_threads_flag_is_documented_and_checked(command):
    help_text = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", command, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert help_text.returncode == 0, help_text.stderr
    assert "--threads N" in help_text.stdout and LOCAL_WORKERS_ENV in help_text.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", command, "--model", "m", "--threads", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--threads" in bad.stderr


@pytest.mark.slow
def test_generate_runs_with_the_threads_it_was_given(tiny_chat_model):
    script = (
        "import sys, torch; from kvbatch.cli import main; "
        "rc = main(sys.argv[1:]); print('threads', torch.get_num_threads()); sys.exit(rc)"
    )
    argv = ["generate", "--model", str(tiny_chat_model), "--prompt", "Hi", "--max-tokens", "2"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv, "--threads", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("threads 1")

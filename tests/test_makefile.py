"""The Makefile's install logic, read through `make -n` (print the commands, run nothing): no
target reaches for apt or sudo, and torch's build follows the machine (CUDA where `nvidia-smi`
lists a GPU, the CPU build elsewhere)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")


def _dry_run(*targets: str, path: str | None = None) -> str:
    """The commands `make -n -B TARGETS` would run (-B: as on a fresh clone)."""
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    env.pop("GPU", None)
    proc = subprocess.run(
        ["make", "-n", "-B", *targets],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _fake_nvidia_smi(folder: Path, listing: str) -> str:
    """A PATH whose nvidia-smi prints `listing` for `-L`, ahead of the real PATH."""
    folder.mkdir()
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' '{listing}'\n")
    script.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize("target", ["test", "run", "compose-check", "venv", "model"])
def test_no_target_installs_system_packages(target):
    commands = _dry_run(target)
    for word in ("apt-get", "apt ", "sudo", "dnf ", "yum ", "brew "):
        assert word not in commands, f"`make {target}` would run {word.strip()}:\n{commands}"


def test_gpu_machine_gets_the_cuda_build(tmp_path):
    path = _fake_nvidia_smi(tmp_path / "bin", "GPU 0: NVIDIA H200 (UUID: GPU-0000)")
    commands = _dry_run("torch", path=path)
    assert "install 'torch==" in commands
    assert "whl/cpu" not in commands and "--no-index" not in commands


def test_machine_without_a_gpu_gets_the_cpu_build(tmp_path):
    # nvidia-smi present (a driver) but listing no GPU counts as no GPU
    path = _fake_nvidia_smi(tmp_path / "bin", "No devices were found")
    commands = _dry_run("torch", path=path)
    assert "--extra-index-url https://download.pytorch.org/whl/cpu 'torch==" in commands
    assert "--no-index --no-deps 'torch==" in commands  # the pin's build on local disk first

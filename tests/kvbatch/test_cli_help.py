"""`kvbatch --help` and `--version`: every flag of the commands a new user runs says what it
does, and the version is the installed distribution's."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from kvbatch.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["run", "worker", "generate", "submit"]  # the commands a new user runs first


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help(command):
    parser = _subcommands(build_parser())[command]
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(flags) > 5
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in flags
        if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()
    ]
    assert not missing, f"kvbatch {command}: no help for {missing}"


def test_every_commands_arguments_have_help():
    """`kvbatch cancel --help` once showed a bare job_id, `resend` a bare --queue."""
    commands = _subcommands(build_parser())
    assert len(commands) >= 12
    missing = {
        name: ["/".join(a.option_strings) or a.dest for a in parser._actions if not a.help]
        for name, parser in commands.items()
    }
    assert not {name: flags for name, flags in missing.items() if flags}


def test_version_is_the_installed_one():
    proc = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kvbatch {importlib.metadata.version('kvbatch')}"

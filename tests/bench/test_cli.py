"""`kvbatch bench`'s command line: a workload's own help, and the benchmarks that take their
own options (`TOOLS`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbatch.bench import cli
from kvbatch.bench.workloads import WORKLOADS


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_a_workload_s_help_describes_that_workload(name, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    workload = WORKLOADS[name]
    assert workload.summary() in out
    assert f"device {workload.device}, dtype {workload.dtype}" in out
    assert "--max-num-seqs" in out  # and the options the workload runs with


def test_help_without_a_workload_lists_them_and_the_tools(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse would break a name at its hyphen
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "side by side" in out and all(name in out for name in cli.TOOLS)


def test_a_tool_takes_the_rest_of_the_command_line():
    """Through the installed `kvbatch` entry point, as a user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "kvbatch.cli", "bench", "spec-copy", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--speculative" in out and "--max-num-seqs" not in out


def test_the_studies_are_not_workloads(capsys):
    """The one-off studies left the package (studies/ in the repository)."""
    assert cli.main(["gc-freeze"]) == 2
    assert "unknown workload 'gc-freeze'" in capsys.readouterr().err

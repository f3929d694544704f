"""`python -m studies`: the registry lists every study and refuses an unknown name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from studies.registry import STUDIES, run

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_name_every_study_is_listed(capsys):
    assert run([]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in STUDIES)


def test_an_unknown_name_is_refused_with_the_known_ones(capsys):
    assert run(["gc-freez"]) == 2
    err = capsys.readouterr().err
    assert "unknown study 'gc-freez'" in err and "gc-freeze" in err


def test_each_study_answers_help_with_its_own_options():
    """Through `python -m studies` in a fresh interpreter, as a reader would run it."""
    out = subprocess.run(
        [sys.executable, "-m", "studies", "step-plan", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "python -m studies step-plan" in out and "--max-num-batched-tokens" in out

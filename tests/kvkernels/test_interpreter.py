"""The known bad Triton interpreter / numpy pairing is named, with the fix."""

from __future__ import annotations

import pytest

import kvkernels.interpreter as interpreter


@pytest.mark.parametrize(
    "triton_v, numpy_v, bad",
    [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False)],
)
def test_interpreter_problem(monkeypatch, triton_v, numpy_v, bad):
    versions = {"triton": triton_v, "numpy": numpy_v}
    monkeypatch.setattr(interpreter, "version", versions.__getitem__)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    problem = interpreter.interpreter_problem()
    assert (problem is not None) == bad
    if bad:
        assert "numpy<2.4" in problem and "triton>=3.7" in problem
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # compiled kernels: no interpreter involved
    assert interpreter.interpreter_problem() is None

"""The known bad Triton interpreter / numpy pairing is named, with the fix; rows per program
of the elementwise kernels: one compiled, a block interpreted."""

from __future__ import annotations

import pytest

import kvbatch.kernels.interpreter as interpreter


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


def test_rows_per_program_is_one_when_compiled(monkeypatch):
    """Compiled kernels keep one program per token (the grid tuned on the H200); only the
    interpreter, which pays per program, takes blocks of rows."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter.rows_per_program() == interpreter.INTERPRETED_ROWS_PER_PROGRAM > 1
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreter.rows_per_program() == 1

"""Triton's interpreter (TRITON_INTERPRET=1) runs these kernels on the CPU: the tests' path.

Known bad pairing: Triton before 3.7 with numpy 2.4 or newer. Its interpreter turns a loop
bound that the kernel loaded from memory (`for tile in range(start, end, BLOCK_N)` with `end`
from a sequence length) into a Python int with `int(array)`, which numpy 2.4 refuses for
1-element arrays. Compiled kernels on CUDA are unaffected. Checked: triton 3.6 fails, 3.7 and
3.9 pass, with numpy 2.4.6; triton 3.6 passes with numpy 2.3.5.

The interpreter also prices work differently from a GPU: it runs the programs of a grid one
after another, each at a fixed Python cost of milliseconds whatever the size of its tiles. The
elementwise kernels (RMSNorm, rotary, KV write, SiLU-and-mul) therefore take a number of rows
per program from `rows_per_program`: one when compiled, the grid the GPU is tuned for, and a
block of rows under the interpreter, which cuts the engine tests' time by several times.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, version

# Rows (tokens) per program of an elementwise kernel under the interpreter: a tiny model's
# step is a few dozen tokens, so most steps take one or two programs.
INTERPRETED_ROWS_PER_PROGRAM = 32


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter (TRITON_INTERPRET=1) rather than
    compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def rows_per_program() -> int:
    """Rows one program of an elementwise kernel handles: 1 when compiled (one program per
    token, as the kernels were tuned for the GPU), a block under the interpreter
    (see the module docstring)."""
    return INTERPRETED_ROWS_PER_PROGRAM if interpreting() else 1


def _major_minor(v: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def interpreter_problem() -> str | None:
    """Why the installed Triton interpreter cannot run our kernels, or None when it can (or
    when the interpreter is not in use)."""
    if not interpreting():
        return None
    try:
        triton_v, numpy_v = version("triton"), version("numpy")
    except PackageNotFoundError:
        return None
    if _major_minor(triton_v) < (3, 7) and _major_minor(numpy_v) >= (2, 4):
        return (
            f"Triton {triton_v}'s interpreter (TRITON_INTERPRET=1) fails with numpy {numpy_v} "
            "('only 0-dimensional arrays can be converted to Python scalars'): install "
            "'numpy<2.4' or 'triton>=3.7' to run the Triton kernels on the CPU"
        )
    return None

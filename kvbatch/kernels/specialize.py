"""Kernel arguments that change from step to step, which Triton must not specialize on.

Triton compiles a kernel once per specialization of its arguments: besides the constexprs,
an int equal to 1 becomes a constant, an int divisible by 16 gets a divisibility hint, and a
pointer that is 16-byte aligned gets an alignment hint. An argument that moves between those
classes from one step to the next makes a new compile in the middle of a run, hundreds of ms
each, a stall of hundreds of decode steps for every running request. The engine's per-step
metadata does exactly that:

    block tables, lengths, positions   views at step-dependent offsets of the one packed
                                       buffer of engine/exec/runner.py `to_device_at_once`: their
                                       alignment flips with the step's sizes
    table widths, split counts         follow the longest context and the batch

Found with scripts/compile_check.py's compile-only driver (sm_90, on the CPU): the engine's
steps, eager ones of varying sizes among them, compiled 15 variants of the prefill kernel and
8 of the decode kernel where their constexprs and pointer types (the CUDA graphs' int32
tables, a step's int64 ones) make 5 and 3. The check now fails on any kernel that compiles
more variants than that (tests/scripts/test_compile_check.py runs it in CI). Data pointers
(q, K/V cache, outputs) keep their hints: they are allocations, aligned every step, and their
loads are the ones that gain from the hints.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import triton


def step_varying(*, ints: Sequence[str] = (), pointers: Sequence[str] = ()):
    """`triton.jit` that specializes neither the named int arguments (on 1 or on divisibility
    by 16) nor the named pointer arguments (on alignment). Triton ignores a name that is not
    an argument, so a misspelt one is an error here instead."""

    def jit(fn):
        unknown = set(ints) | set(pointers)
        unknown -= set(inspect.signature(fn).parameters)
        if unknown:
            raise TypeError(f"{fn.__name__} has no argument {', '.join(sorted(unknown))}")
        return triton.jit(
            fn, do_not_specialize=list(ints), do_not_specialize_on_alignment=list(pointers)
        )

    return jit

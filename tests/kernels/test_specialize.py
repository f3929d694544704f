"""kernels/specialize.py: `step_varying` names arguments that exist.

(That the engine's kernels then compile once per set of constexprs is checked by compiling
them for sm_90: tests/scripts/test_compile_check.py.)"""

from __future__ import annotations

import pytest
import triton.language as tl

from kvbatch.kernels.specialize import step_varying


def test_a_name_that_is_not_an_argument_is_refused():
    def kernel(x_ptr, lens_ptr, n, BLOCK: tl.constexpr):
        pass

    with pytest.raises(TypeError, match="kernel has no argument len_ptr, m"):
        step_varying(ints=("n", "m"), pointers=("x_ptr", "len_ptr"))(kernel)
    jitted = step_varying(ints=("n",), pointers=("lens_ptr",))(kernel)
    assert jitted.fn is kernel

"""The Triton decode step of the gated delta rule against its torch reference (under
TRITON_INTERPRET=1 on the CPU): outputs, and states updated in their own slots only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvbatch.kernels.gated_delta import gated_delta_step, l2_normalize
from kvbatch.kernels.gated_delta_step import gated_delta_step_slots


@pytest.mark.parametrize("dk,dv", [(8, 12), (16, 16)])
def test_the_kernel_equals_the_torch_step(dk, dv):
    gen = torch.Generator().manual_seed(dk)
    batch, heads, num_slots = 3, 4, 6
    q = l2_normalize(torch.randn(batch, heads, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(batch, heads, dk, generator=gen))
    v = torch.randn(batch, heads, dv, generator=gen)
    g = -F.softplus(torch.randn(batch, heads, generator=gen))
    beta = torch.rand(batch, heads, generator=gen)
    states = torch.randn(num_slots, heads, dk, dv, generator=gen)
    slots = torch.tensor([4, 0, 2])
    want_states = states.clone()
    gathered = want_states[slots]
    want = gated_delta_step(q, k, v, g, beta, gathered)
    want_states[slots] = gathered
    got = gated_delta_step_slots(q, k, v, g, beta, states, slots)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states, atol=1e-5, rtol=1e-5)  # others untouched

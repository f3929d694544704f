"""The decode step of the gated delta rule as one Triton kernel: every sequence's token, each
value head's state read from and written back to its slot of the state pool in place.

Same math as kernels/gated_delta.py's gated_delta_step (its torch reference), per (sequence,
value head), with the state [Dk, Dv] in one block of registers:

    S = exp(g) * S;  delta = beta * (v - S^T k);  S += k delta^T;  o = S^T q

The torch reference gathers the slots' states, updates the copies and scatters them back (three
passes over every state); the kernel reads and writes each state once. q and k come prepared
(value heads, normalised, q scaled), everything float32. Tested under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta_step_kernel(
    q_ptr,  # [B, H, DK]
    k_ptr,  # [B, H, DK]
    v_ptr,  # [B, H, DV]
    g_ptr,  # [B, H]
    beta_ptr,  # [B, H]
    state_ptr,  # [slots, H, DK, DV], updated in place
    slot_ptr,  # [B] int64
    out_ptr,  # [B, H, DV]
    num_heads,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * num_heads + head
    slot = tl.load(slot_ptr + seq)
    rk = tl.arange(0, BLOCK_K)
    rv = tl.arange(0, BLOCK_V)
    mk = rk < DK
    mv = rv < DV
    q = tl.load(q_ptr + row * DK + rk, mask=mk, other=0.0)
    k = tl.load(k_ptr + row * DK + rk, mask=mk, other=0.0)
    v = tl.load(v_ptr + row * DV + rv, mask=mv, other=0.0)
    g = tl.load(g_ptr + row)
    beta = tl.load(beta_ptr + row)
    offsets = (slot * num_heads + head) * DK * DV + rk[:, None] * DV + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(state_ptr + offsets, mask=mask, other=0.0)
    s = s * tl.exp(g)
    predicted = tl.sum(s * k[:, None], axis=0)  # S^T k: [DV]
    delta = (v - predicted) * beta
    s = s + k[:, None] * delta[None, :]
    out = tl.sum(s * q[:, None], axis=0)
    tl.store(state_ptr + offsets, s, mask=mask)
    tl.store(out_ptr + row * DV + rv, out, mask=mv)


def gated_delta_step_slots(
    q: torch.Tensor,  # [B, H, Dk] float32
    k: torch.Tensor,  # [B, H, Dk]
    v: torch.Tensor,  # [B, H, Dv]
    g: torch.Tensor,  # [B, H]
    beta: torch.Tensor,  # [B, H]
    states: torch.Tensor,  # [slots, H, Dk, Dv] float32, updated in place
    slots: torch.Tensor,  # [B] int64: each sequence's slot
) -> torch.Tensor:  # [B, H, Dv]
    """One token of each of B sequences, their states updated in their slots."""
    batch, heads, dk = q.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.contiguous().float() for x in (q, k, v, g, beta))
    out = torch.empty(batch, heads, dv, dtype=torch.float32, device=q.device)
    if batch == 0:
        return out
    _gated_delta_step_kernel[(batch, heads)](
        q, k, v, g, beta, states, slots.contiguous(), out, heads,
        DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=triton.next_power_of_2(dv),
    )  # fmt: skip
    return out

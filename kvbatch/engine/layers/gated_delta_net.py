"""The Gated DeltaNet layer (linear attention) of Qwen3-Next and Qwen3.5, over the flat batch
of a step, reading and writing each sequence's states in the state pool:

    qkv, z, b, a = in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x)
    qkv = SiLU(causal depthwise conv1d(qkv))      the conv state: the last kernel - 1 inputs
    q, k = l2norm(q), l2norm(k); q *= Dk^-0.5     q, k per key head, shared by value heads
    g = -exp(A_log) * softplus(a + dt_bias)       log decay per value head; beta = sigmoid(b)
    o = gated delta rule(q, k, v, g, beta)        the recurrent state (kernels/gated_delta.py)
    out_proj(gated RMSNorm(o, z))                 w * norm(o) * silu(z), per value head

Decodes (one token each) run as one batched step over their slots; a prompt chunk runs the
chunked rule from its slot's state, cut where the step asks for snapshots so that the states
at those offsets are copied out exactly (engine/kv/state_slots.py). Qwen3-Next's fused
in_proj_qkvz / in_proj_ba are split into these four at load (engine/models/qwen3_next.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbatch.engine.kv.state_slots import StatePool, StateSpan, StateStep
from kvbatch.engine.layers.kernel_op import KernelOp
from kvbatch.engine.model.linear_attention import LinearAttentionConfig
from kvbatch.kernels.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    gated_delta_chunked,
    gated_delta_step,
    l2_normalize,
)
from kvbatch.kernels.gated_delta_step import gated_delta_step_slots

CHUNK_SIZE = 64  # tokens per chunk of the chunked rule (fla's and transformers' size)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times silu(z): w * x_hat * silu(z), with w around one
    (not zero-centred like the model's other norms); x_hat cast to the model's dtype before
    the weight, the gate in float32, as transformers computes it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., dim] twice
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return (out * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(KernelOp):
    """On the triton backend the decodes' rule is one kernel over their slots
    (kernels/gated_delta_step.py); prompt chunks run the torch chunked form on both."""

    def __init__(self, hidden_size: int, cfg: LinearAttentionConfig, eps: float, index: int):
        super().__init__()
        self.cfg = cfg
        self.index = index  # this layer's place among the linear layers (its pool row)
        self.in_proj_qkv = nn.Linear(hidden_size, cfg.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, cfg.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, cfg.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(
            cfg.conv_dim, cfg.conv_dim, cfg.conv_kernel, groups=cfg.conv_dim, bias=False
        )  # only its weight [conv_dim, 1, kernel] is used
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.num_value_heads))
        self.norm = GatedRMSNorm(cfg.value_head_dim, eps)
        self.out_proj = nn.Linear(cfg.value_dim, hidden_size, bias=False)

    def forward_torch(self, x: torch.Tensor, step: StateStep, pool: StatePool) -> torch.Tensor:
        return self.run(x, step, pool, fused_decode=False)

    def forward_triton(self, x: torch.Tensor, step: StateStep, pool: StatePool) -> torch.Tensor:
        return self.run(x, step, pool, fused_decode=True)

    def run(self, x: torch.Tensor, step: StateStep, pool: StatePool, fused_decode: bool):
        cfg = self.cfg
        t = x.shape[0]
        qkv = self.in_proj_qkv(x)  # [T, conv_dim]
        z = self.in_proj_z(x).view(t, cfg.num_value_heads, cfg.value_head_dim)
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0, :]  # [conv_dim, kernel]
        conv_states = pool.conv[self.index]  # [slots, conv_dim, kernel - 1]
        states = pool.recurrent[self.index]  # [slots, Hv, Dk, Dv]
        out = torch.empty(t, cfg.num_value_heads, cfg.value_head_dim, device=x.device)
        for span in step.prefills:  # first: they fill snapshots that decodes may start from
            self._prefill(span, qkv, g, beta, weight, conv_states, states, out)
        d = step.num_decodes
        if d:
            slots = step.decode_slots
            for row, source in step.decode_inits:
                conv_states[int(slots[row])] = conv_states[source]
                states[int(slots[row])] = states[source]
            conv = conv_states[slots]
            mixed = causal_conv1d_step(qkv[:d], weight, conv)
            conv_states[slots] = conv
            q, k, v = self._heads(mixed)
            if fused_decode:
                out[:d] = gated_delta_step_slots(q, k, v, g[:d], beta[:d], states, slots)
            else:
                s = states[slots]
                out[:d] = gated_delta_step(q, k, v, g[:d], beta[:d], s)
                states[slots] = s
            for row, snapshot in step.decode_snapshots:
                conv_states[snapshot] = conv_states[int(slots[row])]
                states[snapshot] = states[int(slots[row])]
        o = self.norm(out.to(x.dtype), z).reshape(t, cfg.value_dim)
        return self.out_proj(o)

    def _prefill(self, span: StateSpan, qkv, g, beta, weight, conv_states, states, out):
        """One prompt chunk from its slot's states, in pieces ending at its snapshots."""
        lo = span.query_start
        cuts = [s.offset for s in span.snapshots if s.offset < span.query_len]
        ends = sorted(set(cuts)) + [span.query_len]
        snapshots = {s.offset: s.slot for s in span.snapshots}
        if span.init_from >= 0:
            conv_states[span.slot] = conv_states[span.init_from]
            states[span.slot] = states[span.init_from]
        conv, state, start = conv_states[span.slot], states[span.slot], 0
        for end in ends:
            rows = slice(lo + start, lo + end)
            mixed, conv = causal_conv1d(qkv[rows], weight, conv)
            q, k, v = self._heads(mixed)
            out[rows], state = gated_delta_chunked(q, k, v, g[rows], beta[rows], state, CHUNK_SIZE)
            if end in snapshots:
                conv_states[snapshots[end]] = conv
                states[snapshots[end]] = state
            start = end
        conv_states[span.slot] = conv
        states[span.slot] = state

    def _heads(self, mixed: torch.Tensor):
        """q, k (value heads, normalised, q scaled) and v from the conv's output, float32."""
        cfg = self.cfg
        n = mixed.shape[0]
        q, k, v = mixed.float().split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        rep = cfg.num_value_heads // cfg.num_key_heads
        q = q.reshape(n, cfg.num_key_heads, cfg.key_head_dim)
        k = k.reshape(n, cfg.num_key_heads, cfg.key_head_dim)
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        q = l2_normalize(q) * cfg.key_head_dim**-0.5
        return q, l2_normalize(k), v.reshape(n, cfg.num_value_heads, cfg.value_head_dim)

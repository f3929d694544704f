"""The gated delta rule and its conv1d against transformers' torch fallbacks (Qwen3-Next's),
and the chunked form against the token-by-token recurrence, with states carried across cuts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from kvbatch.kernels.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    gated_delta_chunked,
    gated_delta_recurrent,
    gated_delta_step,
    l2_normalize,
)


def _inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=gen)
    k = torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(t, hv, generator=gen))
    beta = torch.rand(t, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _prepared(q, k, hv):
    """q and k as our kernels take them: value heads, normalised, q scaled."""
    rep = hv // q.shape[1]
    q, k = (l2_normalize(x.repeat_interleave(rep, dim=1)) for x in (q, k))
    return q * q.shape[-1] ** -0.5, k


@pytest.mark.parametrize("t,chunk", [(1, 4), (13, 4), (64, 16), (37, 64)])
def test_chunked_equals_recurrent_and_transformers(t, chunk):
    q, k, v, g, beta, state = _inputs(t)
    qp, kp = _prepared(q, k, v.shape[1])
    out_r, s_r = gated_delta_recurrent(qp, kp, v, g, beta, state)
    out_c, s_c = gated_delta_chunked(qp, kp, v, g, beta, state, chunk_size=chunk)
    torch.testing.assert_close(out_c, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=1e-5)
    args = dict(initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    b = [x[None] for x in (q, k, v)]
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(
        *b, g=g[None], beta=beta[None], chunk_size=chunk, **args
    )
    torch.testing.assert_close(out_c, ref_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_c, ref_state[0], atol=1e-5, rtol=1e-5)
    rec_out, rec_state = hf.torch_recurrent_gated_delta_rule(*b, g=g[None], beta=beta[None], **args)
    torch.testing.assert_close(out_r, rec_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_r, rec_state[0], atol=1e-5, rtol=1e-5)


def test_state_carried_across_cuts_equals_one_pass():
    q, k, v, g, beta, state = _inputs(50, seed=1)
    qp, kp = _prepared(q, k, v.shape[1])
    whole, s_whole = gated_delta_chunked(qp, kp, v, g, beta, state, chunk_size=16)
    parts, s = [], state
    for lo, hi in [(0, 7), (7, 30), (30, 31), (31, 50)]:
        out, s = gated_delta_chunked(qp[lo:hi], kp[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s, 16)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_whole, atol=1e-5, rtol=1e-5)


def test_batched_step_is_each_sequence_alone():
    seqs = [_inputs(1, seed=s) for s in range(3)]
    states = torch.stack([s[5] for s in seqs])
    prepared = [_prepared(s[0], s[1], 4) for s in seqs]
    out = gated_delta_step(
        torch.cat([p[0] for p in prepared]),
        torch.cat([p[1] for p in prepared]),
        torch.cat([s[2] for s in seqs]),
        torch.cat([s[3] for s in seqs]),
        torch.cat([s[4] for s in seqs]),
        states,
    )
    for i, (s, (qp, kp)) in enumerate(zip(seqs, prepared)):
        ref, ref_state = gated_delta_recurrent(qp, kp, s[2], s[3], s[4], s[5])
        torch.testing.assert_close(out[i], ref[0])
        torch.testing.assert_close(states[i], ref_state)


def test_conv1d_matches_transformers_with_state_across_cuts():
    gen = torch.Generator().manual_seed(2)
    channels, width, t = 12, 4, 11
    x = torch.randn(t, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    ref = hf.causal_conv1d_fn(x.T[None], weight, None, activation="silu")[0].T
    state = torch.zeros(channels, width - 1)
    a, state = causal_conv1d(x[:5], weight, state)
    b, state = causal_conv1d(x[5:9], weight, state)
    steps = []
    states = state[None].clone()
    for i in range(9, t):
        steps.append(causal_conv1d_step(x[i : i + 1], weight, states))
    torch.testing.assert_close(torch.cat([a, b, *steps]), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[0], x[t - width + 1 :].T)
    # transformers' decode update agrees with our step
    hf_state = state[None].clone()
    upd = hf.causal_conv1d_update(x[9:10].T[None], hf_state, weight, None, activation="silu")
    torch.testing.assert_close(upd[0, :, 0], steps[0][0], atol=1e-6, rtol=1e-6)

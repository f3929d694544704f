"""The gated delta rule (Gated DeltaNet, Yang et al. 2024) and the causal depthwise conv1d in
front of it: plain-torch references for one sequence, and the batched one-token step decode
runs. Qwen3-Next and Qwen3.5 run three of these linear-attention layers to each attention one.

Per value head, a state S of [key_dim, value_dim] replaces the KV cache. For each token t:

    S = exp(g_t) * S                          decay (g_t <= 0, in log space)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T  the delta rule: write the correction of what
                                              S already predicts for k_t, at rate beta_t
    o_t = S^T q_t

`gated_delta_recurrent` is that loop; `gated_delta_chunked` computes the same thing over chunks
of C tokens with matmuls (the WY / UT form: within a chunk the C rank-one updates become one
triangular solve), and is what prefill runs. Both take and return the state, so a prompt cut
into chunks by the scheduler, or split at a snapshot point, gives the state the whole prompt
would. transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule are the
judge of the math (tests/kernels/test_gated_delta.py).

Inputs here are already prepared: q and k expanded to the value heads, L2-normalised, and q
scaled by key_dim^-0.5; everything float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_step(
    q: torch.Tensor,  # [..., H, Dk]
    k: torch.Tensor,  # [..., H, Dk]
    v: torch.Tensor,  # [..., H, Dv]
    g: torch.Tensor,  # [..., H] log decay
    beta: torch.Tensor,  # [..., H]
    state: torch.Tensor,  # [..., H, Dk, Dv], updated in place
) -> torch.Tensor:  # [..., H, Dv]
    """One token of the rule for any leading batch shape: a decode step of many sequences at
    once, each with its own state."""
    state.mul_(g.exp()[..., None, None])
    predicted = (state * k.unsqueeze(-1)).sum(dim=-2)  # S^T k: [..., H, Dv]
    delta = (v - predicted) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (state * q.unsqueeze(-1)).sum(dim=-2)


def gated_delta_recurrent(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, Dv], final state (a new tensor)
    """The rule token by token: the reference the chunked form is checked against."""
    state = state.clone()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        out[t] = gated_delta_step(q[t], k[t], v[t], g[t], beta[t], state)
    return out, state


def gated_delta_chunked(
    q: torch.Tensor,  # [T, H, Dk]
    k: torch.Tensor,  # [T, H, Dk]
    v: torch.Tensor,  # [T, H, Dv]
    g: torch.Tensor,  # [T, H]
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, Dk, Dv]
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, Dv], final state (a new tensor)
    """The rule over chunks of `chunk_size` tokens. Within a chunk, with cumulative log decay
    c_i, the updates solve (I + L) U = beta V - (beta K e^c) S, L the strictly lower part of
    beta_i k_i.k_j e^(c_i - c_j); the chunk's outputs are Q e^c S + (QK^T masked, decayed) U,
    and the state becomes e^(c_last) S + (K e^(c_last - c))^T U. Padding tokens (k = 0,
    beta = 0, g = 0) leave the state as it is."""
    length = q.shape[0]
    pad = (-length) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))  # [H, T', D]
    g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))  # [H, T']
    heads = q.shape[0]
    n = q.shape[1] // chunk_size
    q, k, v = (x.reshape(heads, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(heads, n, chunk_size) for x in (g, beta))
    c = g.cumsum(dim=-1)  # [H, n, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored (unitriangular)
    new_values = torch.linalg.solve_triangular(
        system, v * beta.unsqueeze(-1), upper=False, unitriangular=True
    )
    k_cum = torch.linalg.solve_triangular(
        system, k_beta * c.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # causal, diagonal included
    q_decayed = q * c.exp().unsqueeze(-1)
    k_to_end = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    chunk_decay = c[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    s = state.clone()
    out = torch.empty_like(new_values)
    for i in range(n):
        u = new_values[:, i] - k_cum[:, i] @ s
        out[:, i] = q_decayed[:, i] @ s + attn[:, i] @ u
        s = s * chunk_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(heads, n * chunk_size, -1)[:, :length].transpose(0, 1)
    return out.contiguous(), s


def causal_conv1d(
    x: torch.Tensor,  # [T, C] one sequence's new inputs
    weight: torch.Tensor,  # [C, K] one filter per channel
    state: torch.Tensor,  # [C, K - 1] the K - 1 inputs before x (zeros at the start)
) -> tuple[torch.Tensor, torch.Tensor]:  # SiLU(conv) [T, C], new state [C, K - 1]
    """The depthwise causal convolution with SiLU over q, k and v: output t reads inputs
    t - K + 1 .. t, the earliest from the state. The new state is the last K - 1 inputs."""
    width = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(out).transpose(0, 1), full[:, full.shape[1] - (width - 1) :].clone()


def causal_conv1d_step(
    x: torch.Tensor,  # [B, C] one new input per sequence
    weight: torch.Tensor,  # [C, K]
    states: torch.Tensor,  # [B, C, K - 1], updated in place
) -> torch.Tensor:  # [B, C]
    """One decode token for each of B sequences: the convolution of a window of K inputs."""
    window = torch.cat([states, x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    states.copy_(window[..., 1:])
    return F.silu((window * weight).sum(dim=-1))

"""Rotary position embedding applied in place to q and k, in one launch.

Semantics are engine/model/rope.py's (and transformers'): the rotate-half layout, not the
interleaved one. For a head x = [x1 | x2] (two halves of head_dim / 2) at position p:

    freqs = float32(p) * inv_freq                      # [head_dim / 2], float32
    cos, sin = cos(freqs).to(x.dtype), sin(freqs).to(x.dtype)
    x1' = x1 * cos - x2 * sin                          # x * cos + rotate_half(x) * sin,
    x2' = x2 * cos + x1 * sin                          # rotate_half(x) = [-x2 | x1]

Each product and the sum are rounded to x's dtype as the module's eager ops are, so float16
results match it to the last bit up to cos/sin's own float32 rounding. inv_freq carries the
checkpoint's scaling (default, linear, llama3), so the kernel needs to know nothing of it.

One program rotates every q and k head of ROWS tokens (one when compiled:
kernels/interpreter.py): cos/sin are computed once per token.
q and k may be strided views (slices of a fused qkv projection); only their strides are used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvbatch.kernels.interpreter import rows_per_program
from kvbatch.kernels.specialize import step_varying


@triton.jit
def _rotate_heads(
    x_ptr,
    tokens,  # [ROWS, 1, 1] int64
    token_mask,  # [ROWS, 1, 1]
    num_heads,
    half,
    stride_t,
    stride_head,
    stride_dim,
    cos,  # [ROWS, 1, BLOCK_HALF] float32
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rotate all heads of the program's tokens, BLOCK_H heads at a time."""
    dtype = x_ptr.dtype.element_ty
    c = cos.to(dtype).to(tl.float32)  # cos/sin rounded to x's dtype, as cos_sin(dtype) does
    s = sin.to(dtype).to(tl.float32)
    dims = tl.arange(0, BLOCK_HALF)[None, None, :]
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)[None, :, None]
        mask = token_mask & (heads < num_heads) & (dims < half)
        ptr1 = x_ptr + tokens * stride_t + heads * stride_head + dims * stride_dim
        ptr2 = ptr1 + half * stride_dim
        x1 = tl.load(ptr1, mask=mask, other=0.0)
        x2 = tl.load(ptr2, mask=mask, other=0.0)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        # Round each product to x's dtype before the sum, as x * cos + rotated * sin does.
        y1 = (x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)
        y2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
        tl.store(ptr1, y1.to(dtype), mask=mask)
        tl.store(ptr2, y2.to(dtype), mask=mask)


@step_varying(ints=("num_tokens",), pointers=("positions_ptr",))
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    inv_freq_ptr,
    num_tokens,
    num_heads,
    num_kv_heads,
    half,
    stride_q_t,
    stride_q_head,
    stride_q_dim,
    stride_k_t,
    stride_k_head,
    stride_k_dim,
    ROWS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    pos = tl.load(positions_ptr + tokens, mask=tokens < num_tokens, other=0).to(tl.float32)
    tokens = tokens[:, None, None]
    token_mask = tokens < num_tokens
    dims = tl.arange(0, BLOCK_HALF)[None, None, :]
    inv_freq = tl.load(inv_freq_ptr + dims, mask=dims < half, other=0.0)
    freqs = pos[:, None, None] * inv_freq  # [ROWS, 1, BLOCK_HALF] float32
    cos = tl.cos(freqs)
    sin = tl.sin(freqs)
    _rotate_heads(
        q_ptr,
        tokens,
        token_mask,
        num_heads,
        half,
        stride_q_t,
        stride_q_head,
        stride_q_dim,
        cos,
        sin,
        BLOCK_HQ,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        tokens,
        token_mask,
        num_kv_heads,
        half,
        stride_k_t,
        stride_k_head,
        stride_k_dim,
        cos,
        sin,
        BLOCK_HK,
        BLOCK_HALF,
    )


# Heads rotated together by one loop step: enough to keep a warp busy at head_dim 64, few
# enough that a 128-head model does not spill registers.
_MAX_HEADS_PER_STEP = 16


def apply_rotary_(
    q: torch.Tensor,  # [T, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], rotated in place
    positions: torch.Tensor,  # [T] int64
    inv_freq: torch.Tensor,  # [head_dim / 2] float32 (kvbatch.engine.model.rope.inverse_frequencies)
) -> None:
    """Rotate q and k in place by each token's position (kvbatch.engine.layers.rotary.RotaryEmbedding)."""
    _check_shapes(q, k, positions, inv_freq)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    rows = rows_per_program()
    _rotary_kernel[(triton.cdiv(num_tokens, rows),)](
        q,
        k,
        positions.contiguous(),
        inv_freq.contiguous(),
        num_tokens,
        num_heads,
        k.shape[1],
        half,
        *q.stride(),
        *k.stride(),
        ROWS=rows,
        BLOCK_HQ=min(triton.next_power_of_2(num_heads), _MAX_HEADS_PER_STEP),
        BLOCK_HK=min(triton.next_power_of_2(k.shape[1]), _MAX_HEADS_PER_STEP),
        BLOCK_HALF=triton.next_power_of_2(half),
    )


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> None:
    """Plain-torch reference: kvbatch.engine.layers.rotary.RotaryEmbedding's cos_sin and apply, written back."""
    _check_shapes(q, k, positions, inv_freq)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim]
    for x in (q, k):
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)


def _check_shapes(q, k, positions, inv_freq) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            "q must be [T, num_heads, head_dim] and k [T, num_kv_heads, head_dim]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim % 2 or inv_freq.shape != (head_dim // 2,):
        raise ValueError(
            f"head_dim ({head_dim}) must be even and inv_freq [head_dim / 2]; "
            f"got inv_freq {tuple(inv_freq.shape)}"
        )
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [{q.shape[0]}], got {tuple(positions.shape)}")

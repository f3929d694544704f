"""Absorbed multi-head latent attention (MLA) for decode steps over the paged latent cache.

MLA (DeepSeek-V2/V3, Kimi K2, Mistral 4) caches one vector per token and layer, shared by all
heads: the normed latent c_kv (R = kv_lora_rank) followed by the rotated RoPE key (P =
qk_rope_head_dim). At decode the up-projections are absorbed: the caller multiplies each
head's non-rotary query by W_UK (q_latent, R wide) and later multiplies the output by W_UV, so
attention runs in the latent space with c_kv as both the key (with k_rope beside it) and the
value:

    score[h, t] = scale * (q_latent[h] . c_kv[t] + q_rope[h] . k_rope[t])
    out[h]      = softmax_t(score[h]) @ c_kv                      [H, R]

    latent_cache[block, pos] = [ c_kv (R)          | k_rope (P) ]
                                 key and value        key only

That is multi-query attention with one KV head of width R + P and values of width R: the
arithmetic per byte read grows with the number of query heads, and the kernel is built
around reading each latent tile as few times as possible.

Tiles of heads: one program serves BLOCK_H heads of one row (a tl.dot needs 16 rows, and
DeepSeek-V3 has 128 heads), so each latent tile [BLOCK_N, R + P] is loaded once for those
heads and used twice from registers, as keys (q_latent @ c_kv^T + q_rope @ k_rope^T) and as
values (p @ c_kv). A program per head would read the whole context H times; 16 heads a tile
keep the float32 accumulator [16, R] (32 KiB at R = 512) in registers.

Split-K (flash-decoding), as kernels/decode_attention.py: a decode step's grid without splits
is rows x head tiles, 8 programs per row for DeepSeek-V3 and 2 for Mistral 4's 32 heads, so a
small batch or one long row leaves most SMs idle while a few programs walk the whole context.
A row's context is cut into `num_splits` ranges, one program per (row, head tile, split)
writes a float32 partial and its log-sum-exp, and decode_attention.py's merge kernel combines
them exactly over the latent width. The splits are chosen from shapes only (batch, head
tiles, table width), so a launch reads no device tensor on the host and can be captured in a
CUDA graph. Each program stops at its row's own length: a short row beside a long one reads
only its own blocks, and its splits past its length are empty (lse -inf, no weight).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvbatch.kernels.decode_attention import (
    LOG2E,
    _merge_splits_kernel,
    choose_num_splits,
    dot_precision,
)
from kvbatch.kernels.specialize import step_varying

BLOCK_H = 16  # heads per program: the smallest tl.dot row count, and the accumulator's limit


@step_varying(
    ints=("stride_tb", "stride_lb", "stride_lh", "tokens_per_split", "max_tokens"),
    pointers=("table_ptr", "seq_lens_ptr"),
)
def _mla_decode_split_kernel(
    q_latent_ptr,  # [B, H, R]
    q_rope_ptr,  # [B, H, P]
    cache_ptr,  # [num_blocks, block_size, R + P]
    table_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, H, S, R] float32 partials, or [B, H, R] when FINAL
    lse_ptr,  # [B, H, S] float32 (log2 units), or [B, H] (natural log) when FINAL
    scale_log2,  # softmax scale * log2(e)
    stride_qlb,
    stride_qlh,
    stride_qld,
    stride_qrb,
    stride_qrh,
    stride_qrd,
    stride_cblk,
    stride_cpos,
    stride_cd,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    num_heads,
    tokens_per_split,
    max_tokens,  # max_blocks * block_size: never index the table past its width
    LATENT: tl.constexpr,  # R
    ROPE: tl.constexpr,  # P
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    FINAL: tl.constexpr,  # one split: write the output and natural-log lse directly
):
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(tl.minimum(seq_len, start + tokens_per_split), max_tokens)

    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_mask = offs_r < LATENT
    p_mask = offs_p < ROPE
    h_mask = offs_h < num_heads
    # a vector, all alike: the interpreter refuses a scalar term in a load's mask
    live_h = h_mask & (tl.zeros([BLOCK_H], tl.int32) + start < end)
    q_latent = tl.load(
        q_latent_ptr + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_r[None, :] * stride_qld,
        mask=live_h[:, None] & r_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    q_rope = tl.load(
        q_rope_ptr + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_p[None, :] * stride_qrd,
        mask=live_h[:, None] & p_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_P]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table = table_ptr + b.to(tl.int64) * stride_tb

    # Every tile holds at least one valid key and padded head rows score 0, so the running
    # max is finite after the first tile: no -inf - -inf.
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slots = blocks * stride_cblk + (offs_n % BLOCK_SIZE) * stride_cpos  # [BLOCK_N]
        c_kv = tl.load(
            cache_ptr + slots[:, None] + offs_r[None, :] * stride_cd,
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_R]: the keys' latent part and the values
        k_rope = tl.load(
            cache_ptr + slots[:, None] + (LATENT + offs_p)[None, :] * stride_cd,
            mask=n_mask[:, None] & p_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_P]
        qk = tl.dot(q_latent, tl.trans(c_kv), input_precision=PRECISION)
        qk = tl.dot(q_rope, tl.trans(k_rope), acc=qk, input_precision=PRECISION)
        qk = tl.where(n_mask[None, :], qk * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0  # split beyond seq_len (or seq_len 0): zeros, lse -inf
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_ptrs = out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_r[None, :] * stride_od
    if FINAL:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & r_mask[None, :])
        tl.store(
            lse_ptr + b * stride_lb + offs_h * stride_lh, lse2 * 0.6931471805599453, mask=h_mask
        )
    else:  # an empty split writes only its lse: the merge never reads its output
        tl.store(o_ptrs + split * stride_os, o, mask=live_h[:, None] & r_mask[None, :])
        tl.store(
            lse_ptr + b * stride_lb + offs_h * stride_lh + split * stride_ls, lse2, mask=h_mask
        )


class MLATiles(NamedTuple):
    block_n: int  # tokens per inner iteration (several cache blocks: one table load)
    num_warps: int
    num_stages: int


def mla_tiles(dtype: torch.dtype, block_r: int, block_p: int) -> MLATiles:
    """Tile and launch settings: the pipelined latent tiles (block_n x (R + P), num_stages of
    them) must fit in shared memory beside the [BLOCK_H, R] float32 accumulator's registers,
    so float32 (tests only) and wide latents get fewer tokens a tile; a wide accumulator
    takes 8 warps, or float32 at R = 256 spills (checked with ptxas for sm_90)."""
    width_bytes = (block_r + block_p) * dtype.itemsize
    block_n = 32 if width_bytes <= 1280 else 16  # DeepSeek-V3 bf16: 1152 bytes a token
    num_warps = 4 if block_r * dtype.itemsize <= 512 else 8  # Mistral 4 bf16: 4
    return MLATiles(block_n=block_n, num_warps=num_warps, num_stages=2)


def check_mla_inputs(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Shapes and dtypes agree: [B, H, R] and [B, H, P] queries, an [N, block_size, R + P]
    cache of the queries' dtype with a contiguous last dim, [B, max_blocks] tables, [B] lens."""
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(
            "q_latent must be [B, H, kv_lora_rank] and q_rope [B, H, qk_rope_head_dim]; got "
            f"{tuple(q_latent.shape)} and {tuple(q_rope.shape)}"
        )
    width = q_latent.shape[2] + q_rope.shape[2]
    if latent_cache.dim() != 3 or latent_cache.shape[2] != width:
        raise ValueError(
            f"latent_cache must be [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim = "
            f"{width}], got shape {tuple(latent_cache.shape)}"
        )
    if latent_cache.stride(2) != 1:
        raise ValueError("latent_cache's last dim must be contiguous (stride 1)")
    if not (q_latent.dtype == q_rope.dtype == latent_cache.dtype):
        raise ValueError(
            f"q_latent, q_rope and latent_cache must share a dtype; got {q_latent.dtype}, "
            f"{q_rope.dtype} and {latent_cache.dtype}"
        )
    batch = q_latent.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"block_tables must be [B = {batch}, max_blocks] and seq_lens [{batch}]; got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )


def mla_decode_attention(
    q_latent: torch.Tensor,  # [B, H, R] queries times W_UK (absorbed), one decode token a row
    q_rope: torch.Tensor,  # [B, H, P] rotated rope part of the queries
    latent_cache: torch.Tensor,  # [num_blocks, block_size, R + P]: c_kv, then k_rope
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [B] tokens each row attends to, the current one included
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * (q_latent . c_kv + q_rope . k_rope)) @ c_kv for each row and head.

    Returns out [B, H, R] in q's dtype (written into `out` when given), and with `return_lse`
    also the float32 natural-log log-sum-exp of the scaled scores [B, H] (for a cascade merge).
    A row of length 0 gives zeros and lse -inf. `num_splits` (flash-decoding) is chosen from
    the batch, the head tiles and the table width when None.
    """
    check_mla_inputs(q_latent, q_rope, latent_cache, block_tables, seq_lens)
    # Unit stride along tables' rows and lengths (no-ops when contiguous: graph-capturable).
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    batch, num_heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    block_size = latent_cache.shape[1]
    max_tokens = block_tables.shape[1] * block_size
    if out is None:
        out = torch.empty_like(q_latent)
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=q_latent.device)
    if batch == 0:
        return (out, lse) if return_lse else out

    block_r = max(16, triton.next_power_of_2(latent))
    block_p = max(16, triton.next_power_of_2(rope))
    tiles = mla_tiles(q_latent.dtype, block_r, block_p)
    head_tiles = triton.cdiv(num_heads, BLOCK_H)
    if num_splits is None:
        num_splits = choose_num_splits(batch, head_tiles, max_tokens, q_latent.device)
        # whole key tiles per split; recount so that no split is empty by construction
        tiles_per_split = max(1, triton.cdiv(triton.cdiv(max_tokens, num_splits), tiles.block_n))
        tokens_per_split = tiles_per_split * tiles.block_n
        num_splits = max(1, triton.cdiv(max_tokens, tokens_per_split))
    else:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        tokens_per_split = max(1, triton.cdiv(max_tokens, num_splits))

    def split_kernel(o: torch.Tensor, o_strides, lse_: torch.Tensor, lse_strides, final: bool):
        _mla_decode_split_kernel[(batch, head_tiles, num_splits)](
            q_latent, q_rope, latent_cache, block_tables, seq_lens, o, lse_, scale * LOG2E,
            *q_latent.stride(), *q_rope.stride(), *latent_cache.stride(), block_tables.stride(0),
            *o_strides, *lse_strides, num_heads, tokens_per_split, max_tokens,
            LATENT=latent, ROPE=rope, BLOCK_SIZE=block_size, BLOCK_H=BLOCK_H, BLOCK_R=block_r,
            BLOCK_P=block_p, BLOCK_N=tiles.block_n, PRECISION=dot_precision(q_latent.dtype),
            FINAL=final, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip

    if num_splits == 1:  # no partials: the output and natural-log lse directly
        split_kernel(
            out, (out.stride(0), out.stride(1), 0, out.stride(2)), lse, (*lse.stride(), 0), True
        )
        return (out, lse) if return_lse else out

    device = q_latent.device
    mid_o = torch.empty(batch, num_heads, num_splits, latent, dtype=torch.float32, device=device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
    split_kernel(mid_o, mid_o.stride(), mid_lse, mid_lse.stride(), False)
    _merge_splits_kernel[(batch, head_tiles)](  # decode's merge, over the latent width
        mid_o, mid_lse, out, lse, lse,  # no sinks: their pointer is not read
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        *out.stride(), *lse.stride(),
        num_heads, num_splits,
        HEAD_DIM=latent, BLOCK_H=BLOCK_H, BLOCK_D=block_r, SINKS=False,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def mla_decode_attention_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,  # accepted for the same signature; the reference never splits
    out: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch absorbed MLA decode (gather, then float32 math), same contract as the
    kernel; also the CPU path."""
    check_mla_inputs(q_latent, q_rope, latent_cache, block_tables, seq_lens)
    batch, _, latent = q_latent.shape
    block_size = latent_cache.shape[1]
    max_blocks = block_tables.shape[1]
    positions = torch.arange(max_blocks * block_size, device=q_latent.device)
    used = positions[None, ::block_size] < seq_lens[:, None]  # [B, max_blocks]
    ids = block_tables.long().masked_fill(~used, 0).reshape(-1)  # padding may hold anything
    # [B, max_blocks * block_size, R + P]
    context = latent_cache.index_select(0, ids).reshape(batch, max_blocks * block_size, -1).float()
    valid = positions[None, :] < seq_lens[:, None]  # [B, S]
    # slots past a row's length may hold anything, NaN included (uninitialised memory)
    context = context.masked_fill(~valid[..., None], 0.0)
    c_kv, k_rope = context[..., :latent], context[..., latent:]
    scores = torch.einsum("bhr,bsr->bhs", q_latent.float(), c_kv)
    scores = (scores + torch.einsum("bhp,bsp->bhs", q_rope.float(), k_rope)) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]; -inf where seq_len is 0
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    result = torch.einsum("bhs,bsr->bhr", probs, c_kv).to(q_latent.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result

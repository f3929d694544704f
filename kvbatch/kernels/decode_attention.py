"""Paged attention for decode steps: one query token per sequence against its cached context.

Flash-decoding: a sequence's context is cut into `num_splits` equal ranges of tokens, one
program per (sequence, kv head, split) computes a partial softmax attention over its range,
and a second small kernel merges the partials exactly with their log-sum-exps. Splitting keeps
the GPU busy when there are few sequences but long contexts; with many sequences one split
suffices and the first kernel writes the output directly.

    context of seq b:  [ split 0 | split 1 | split 2 ]      tokens_per_split each (the last
                          |          |         |            ones may be partial or empty)
                        (o0,lse0) (o1,lse1) (o2,lse2)  -->  merge  -->  out[b], lse[b]

An FP8 cache (E4M3, kv_cache_dtype="fp8") holds k / k_scale and v / v_scale: K/V tiles are
widened to q's dtype in registers (exact: every E4M3 value is a float16 and a bfloat16),
k_scale folds into the softmax scale and v_scale multiplies the output once.

GQA packing: one program handles all G query heads of its kv head, so each K/V tile is read
once for the G heads; the G rows are padded to 16 for tl.dot and masked.

The launch never reads a device tensor on the host (grid and splits come from shapes only),
so it can be captured in a CUDA graph whose replays change `seq_lens` but not shapes.

Layer variants (kvbatch.engine.attention.layer_spec): a sliding window starts each row's keys
at seq_len - window (the splits before it are empty); a soft-cap bends every score to
cap * tanh(score / cap) before the softmax (in log2 units: C * tanh(x / C) with C = cap *
log2(e), the same function); `scale` replaces head_dim ** -0.5. Sinks (gpt-oss: one logit per
head in the denominator, no value) join once a row's whole softmax is known, in the single
split's epilogue or after the merge (`join_sink`): out * exp(lse - logaddexp(lse, sink)), and
the returned lse includes the sink, so a later merge (cascade) still counts it once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvbatch.kernels.specialize import step_varying

LOG2E = 1.4426950408889634  # scores go through exp2: log2(e) is folded into the scale

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism
# Tables wider than LONG_TABLE_TOKENS (the engine's wide decode graphs, and eager steps with a
# long context) cut it into splits of at most LONG_TOKENS_PER_SPLIT tokens whatever the batch.
LONG_TABLE_TOKENS = 8192
LONG_TOKENS_PER_SPLIT = 2048


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), from one exp of a non-positive number (no overflow)."""
    y = x / cap
    t = tl.exp(-2.0 * tl.abs(y))
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(y < 0, -th, th)


@triton.jit
def join_sink(o, lse, sink):
    """(o [R, D], lse [R]) of a row's keys with the sink logit [R] joined to the denominator
    (natural-log units): a row with no key (lse -inf) gives zeros and lse = sink."""
    m = tl.maximum(lse, sink)
    total = m + tl.log(tl.exp(lse - m) + tl.exp(sink - m))
    return o * tl.exp(lse - total)[:, None], total


@step_varying(
    ints=("stride_tb", "stride_lb", "stride_lh", "tokens_per_split", "max_tokens", "window"),
    pointers=("table_ptr", "seq_lens_ptr"),
)
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    kv_ptr,  # [2, num_blocks, block_size, KVH, D]
    table_ptr,  # [B, max_blocks]
    seq_lens_ptr,  # [B]
    out_ptr,  # [B, H, S, D] float32 partials, or [B, H, D] when FINAL
    lse_ptr,  # [B, H, S] float32 (log2 units), or [B, H] (natural log) when FINAL
    scale_log2,  # softmax scale * log2(e) * k_scale
    v_scale,  # 1.0 unless the cache is FP8
    window,  # keys per query in a sliding-window layer; 0: every key
    softcap_log2,  # soft-cap * log2(e), used when SOFTCAP
    sinks_ptr,  # [H] float32 sink logits, read when SINKS (and FINAL)
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kv,
    stride_kblk,
    stride_kpos,
    stride_kh,
    stride_kd,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    tokens_per_split,
    max_tokens,  # max_blocks * block_size: never index the table past its width
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    G: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    FINAL: tl.constexpr,  # one split: write the output and natural-log lse directly
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(tl.minimum(seq_len, start + tokens_per_split), max_tokens)
    if window > 0:  # the query (position seq_len - 1) sees the last `window` keys
        start = tl.maximum(start, seq_len - window)

    # A split past seq_len (most of a wide table's splits: short rows beside a long one)
    # reads and writes nothing but its lse (-inf): the merge skips its partial output.
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    # a vector, all alike: the interpreter refuses a scalar term in a load's mask
    live_g = g_mask & (tl.zeros([BLOCK_G], tl.int32) + start < end)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * G + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=live_g[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = kv_ptr + kvh * stride_kh
    table = table_ptr + b.to(tl.int64) * stride_tb

    # Every tile holds at least one valid key and padded head rows score 0, so the running
    # max is finite after the first tile: no -inf - -inf.
    for tile in range(start, end, BLOCK_N):
        offs_n = tile + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slots = blocks * stride_kblk + (offs_n % BLOCK_SIZE) * stride_kpos  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kv_offs = slots[:, None] + offs_d[None, :] * stride_kd  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # FP8: dequantized
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        if SOFTCAP:
            qk = soft_cap(qk, softcap_log2)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(k_base + stride_kv + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    empty = l_i == 0.0  # split beyond seq_len (or seq_len 0): zeros, lse -inf
    o = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_mask = g_mask[:, None] & d_mask[None, :]
    o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    if FINAL:
        lse = lse2 * 0.6931471805599453
        if SINKS:
            o, lse = join_sink(o, lse, tl.load(sinks_ptr + heads, mask=g_mask, other=0.0))
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh, lse, mask=g_mask)
    else:
        tl.store(o_ptrs + split * stride_os, o, mask=live_g[:, None] & d_mask[None, :])
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse2, mask=g_mask)


@step_varying(ints=("stride_lmb", "stride_lmh", "num_splits"))
def _merge_splits_kernel(
    mid_o_ptr,  # [B, H, S, D] float32
    mid_lse_ptr,  # [B, H, S] float32, log2 units
    out_ptr,  # [B, H, D]
    lse_ptr,  # [B, H] float32, natural log
    sinks_ptr,  # [H] float32, read when SINKS
    stride_mb,
    stride_mh,
    stride_ms,
    stride_lmb,
    stride_lmh,
    stride_ob,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < num_heads
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    o, lse = merge_split_partials(
        mid_o_ptr + b * stride_mb + offs_h[:, None] * stride_mh + offs_d[None, :],
        mid_lse_ptr + b * stride_lmb + offs_h * stride_lmh,
        stride_ms,
        1,
        num_splits,
        h_mask,
        mask,
    )
    if SINKS:
        o, lse = join_sink(o, lse, tl.load(sinks_ptr + offs_h, mask=h_mask, other=0.0))
    tl.store(
        out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(lse_ptr + b * stride_lb + offs_h * stride_lh, lse, mask=h_mask)


@triton.jit
def merge_split_partials(
    o_ptrs, lse_ptrs, stride_o_split, stride_lse_split, num_splits, row_mask, mask
):
    """Online merge of `num_splits` partial attentions of the same rows over disjoint key
    ranges: o_ptrs [R, D] and lse_ptrs [R] (float32, log2 units) point at split 0. Returns the
    merged output [R, D] (float32) and natural-log lse [R]. An empty split (lse -inf) weighs
    nothing and its output is not read (the decode kernel leaves it unwritten); rows whose
    splits are all empty get zeros and lse -inf."""
    m = tl.full(lse_ptrs.shape, float("-inf"), tl.float32)
    total = tl.zeros(lse_ptrs.shape, tl.float32)
    acc = tl.zeros(o_ptrs.shape, tl.float32)
    for s in range(num_splits):
        lse_s = tl.load(lse_ptrs + s * stride_lse_split, mask=row_mask, other=float("-inf"))
        o_s = tl.load(
            o_ptrs + s * stride_o_split, mask=mask & (lse_s > float("-inf"))[:, None], other=0.0
        )
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse_s - m_safe)
        total = total * alpha + w
        acc = acc * alpha[:, None] + o_s * w[:, None]
        m = m_new
    empty = total == 0.0
    o = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, total)))
    return o, lse * 0.6931471805599453


class DecodeTiles(NamedTuple):
    block_n: int  # keys per inner iteration (several KV blocks: ids gathered with one table load)
    num_warps: int
    num_stages: int


def decode_tiles(dtype: torch.dtype, block_d: int) -> DecodeTiles:
    """Tile and launch settings; the pipelined K/V tiles (block_n x block_d x num_stages, twice)
    must fit in shared memory, so float32 (tests only) gets half-size tiles."""
    if dtype.itemsize >= 4:
        return DecodeTiles(block_n=32, num_warps=4, num_stages=2)
    return DecodeTiles(block_n=64, num_warps=4, num_stages=3 if block_d <= 128 else 2)


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter: behave like an H100/H200 so the same splits are chosen


def choose_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits per sequence so that about two waves of programs fill the GPU, keeping at least
    MIN_TOKENS_PER_SPLIT tokens per split (from shapes only: capturable in a CUDA graph).

    A wide table usually means one long context beside many short ones (a 32k prompt that
    finished prefilling decodes with 64 chat requests): the batch alone fills the GPU, but the
    long row's few programs then read all of its keys serially while the rest of the GPU idles,
    and the step takes as long as they do (several times a plain step; docs/BENCHMARKS.md has
    the long-prefill figures). So a wide table gets a split per
    LONG_TOKENS_PER_SPLIT tokens; the short rows' extra splits are empty and write only their
    lse (-inf), but they are still programs to launch: hence no splits of a few hundred keys."""
    programs = max(1, batch * num_kv_heads)
    wanted = triton.cdiv(2 * num_sms(device), programs)
    if max_tokens > LONG_TABLE_TOKENS:
        wanted = max(wanted, triton.cdiv(max_tokens, LONG_TOKENS_PER_SPLIT))
    useful = max(1, max_tokens // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, 64))


def dot_precision(dtype: torch.dtype) -> str | None:
    """float32 dots in full precision (tests hold them to 1e-4); others use the default."""
    return "ieee" if dtype == torch.float32 else None


def check_attention_inputs(q: torch.Tensor, kv_cache: torch.Tensor, rows: int, name: str) -> None:
    """Shapes of q and the cache agree (heads a multiple of kv heads, equal head dims)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [{name}, num_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q has {num_heads} heads of dim {head_dim}; the cache has {num_kv_heads} kv heads "
            f"of dim {kv_cache.shape[4]} (heads must be a multiple of kv heads, dims equal)"
        )
    if q.shape[0] != rows:
        raise ValueError(f"q has {q.shape[0]} rows but the tables describe {rows}")


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [B] keys 0 .. seq_len - 1; 0 gives zeros and lse -inf
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: the stored values times these are K and V
    v_scale: float = 1.0,
    sliding_window: int | None = None,  # keys per query (itself included); None: all
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits joined to each denominator
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token per sequence over its paged context.

    Returns out [B, num_heads, head_dim] in q's dtype (written into `out` when given), and with
    `return_lse` also the float32 natural-log log-sum-exp of the scaled scores [B, num_heads]
    (with the sinks' terms when `sinks` is given).
    `num_splits` (flash-decoding) is chosen from B and the table width when None.
    """
    check_attention_inputs(q, kv_cache, block_tables.shape[0], "B")
    # Unit stride along tables' rows and lengths (no-ops when contiguous: graph-capturable).
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    g = num_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size
    scale = head_dim**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(batch, num_heads, dtype=torch.float32, device=q.device)
    if batch == 0:
        return (out, lse) if return_lse else out
    sinks_f32 = check_sinks(sinks, num_heads, lse)

    block_d = max(16, triton.next_power_of_2(head_dim))
    tiles = decode_tiles(q.dtype, block_d)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_tokens, q.device)
        # whole key tiles per split; recount so that no split is empty by construction
        tiles_per_split = max(1, triton.cdiv(triton.cdiv(max_tokens, num_splits), tiles.block_n))
        tokens_per_split = tiles_per_split * tiles.block_n
        num_splits = max(1, triton.cdiv(max_tokens, tokens_per_split))
    else:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        tokens_per_split = max(1, triton.cdiv(max_tokens, num_splits))

    def split_kernel(o: torch.Tensor, o_strides, lse_: torch.Tensor, lse_strides, final: bool):
        _decode_split_kernel[(batch, num_kv_heads, num_splits)](
            q, kv_cache, block_tables, seq_lens, o, lse_, scale * LOG2E * k_scale, v_scale,
            sliding_window or 0, (softcap or 0.0) * LOG2E, sinks_f32,
            *q.stride(), *kv_cache.stride(), block_tables.stride(0), *o_strides, *lse_strides,
            tokens_per_split, max_tokens,
            G=g, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d, BLOCK_N=tiles.block_n,
            PRECISION=dot_precision(q.dtype), FINAL=final, SOFTCAP=softcap is not None,
            SINKS=sinks is not None, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip

    if num_splits == 1:  # no partials: the output and natural-log lse directly
        split_kernel(
            out, (out.stride(0), out.stride(1), 0, out.stride(2)), lse, (*lse.stride(), 0), True
        )
        return (out, lse) if return_lse else out

    mid_o = torch.empty(
        batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    split_kernel(mid_o, mid_o.stride(), mid_lse, mid_lse.stride(), False)
    block_h = min(16, triton.next_power_of_2(num_heads))
    _merge_splits_kernel[(batch, triton.cdiv(num_heads, block_h))](
        mid_o, mid_lse, out, lse, sinks_f32,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        *out.stride(),
        *lse.stride(),
        num_heads, num_splits,
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, SINKS=sinks is not None,
        num_warps=4,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def check_sinks(sinks: torch.Tensor | None, num_heads: int, like: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them (float32, contiguous); without sinks a stand-in
    pointer (`like`) that is never read."""
    if sinks is None:
        return like
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [num_heads] = [{num_heads}], got {tuple(sinks.shape)}")
    return sinks.float().contiguous()


def join_sink_ref(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' sink: out [..., H, D] (float32) and lse [..., H] with the sink joined."""
    if sinks is None:
        return out, lse
    total = torch.logaddexp(lse, sinks.float())
    return out * torch.exp(lse - total)[..., None], total


def paged_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,  # accepted for the same signature; the reference never splits
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch paged decode attention (float32 math), same contract as the kernel."""
    check_attention_inputs(q, kv_cache, block_tables.shape[0], "B")
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    g = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    max_blocks = block_tables.shape[1]
    used = torch.arange(max_blocks, device=q.device)[None, :] * block_size < seq_lens[:, None]
    ids = block_tables.long().masked_fill(~used, 0).reshape(-1)  # padding may hold anything
    # [B, max_blocks * block_size, kv_heads, head_dim] -> [B, heads, S, head_dim]
    keys = kv_cache[0].index_select(0, ids).view(batch, max_blocks * block_size, num_kv_heads, -1)
    values = kv_cache[1].index_select(0, ids).view(batch, max_blocks * block_size, num_kv_heads, -1)
    keys = (keys.float() * k_scale).repeat_interleave(g, dim=2).transpose(1, 2)
    values = (values.float() * v_scale).repeat_interleave(g, dim=2).transpose(1, 2)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(max_blocks * block_size, device=q.device)[None, :]
    valid = positions < seq_lens[:, None]
    if sliding_window is not None:
        valid &= positions >= seq_lens[:, None] - sliding_window
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H]; -inf where seq_len is 0
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    result, lse = join_sink_ref(torch.einsum("bhs,bhsd->bhd", probs, values), lse, sinks)
    result = result.to(q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result

"""Paged attention for prefill chunks: many query rows per sequence, variable lengths.

Sequence s owns query rows [query_start, query_start + query_len) of the flat q and attends to
context_len keys in its blocks. Causal: its queries are the last query_len positions of the
context (chunked prefill: a chunk sees its cached prefix and, causally, itself):

    keys:     0 1 2 3 4 5 6 7 8 9          context_len 10, query_len 4 (cached prefix 6)
    query 0:  x x x x x x x                query i sits at position 6 + i and sees keys <= it
    query 3:  x x x x x x x x x x

Non-causal: every query sees all context_len keys (cascade attention: a group of decoding rows
against the group's shared prefix blocks).

GQA packing: one program serves all G query heads of a kv head. Its BLOCK_M rows are
(query position, head) pairs, row r = position r // G, head r % G, so every K/V tile is read
once for the G heads and a tile holds BLOCK_M // G positions.

Each program runs two loops over key tiles: first the keys every row of the tile may see
(no mask at all), then the rest up to the tile's last visible key (masked: diagonal of the
causal mask, end of the context).

An FP8 cache is read as in kernels/decode_attention.py: tiles widened to q's dtype in
registers, k_scale folded into the softmax scale, v_scale applied to the output.

Split keys (flash-decoding for chunks): a short chunk after a long context gives few programs
(a 256-token chunk of a 32k prompt, G 4, 8 kv heads: 8 row tiles x 8 = 64 programs on 132
SMs), each walking all 32k keys alone. Then each sequence's keys are cut into `num_splits`
ranges of whole key tiles (sized from its own context length, in the kernel, so a launch
needs no lengths on the host and can sit in a CUDA graph), one program per (row tile, split)
writes a float32 partial and its log-sum-exp, and a merge kernel over the same row tiles
combines them exactly (the cascade merge's arithmetic,
kernels/decode_attention.merge_split_partials):

    keys of seq s:  [ split 0 | split 1 | split 2 ]  ->  (o, lse) each  ->  merge  ->  out

Layer variants (kvbatch.engine.attention.layer_spec), as in the decode kernel: a soft-cap on
the scores, another scale, and a sliding window. With a window every key tile goes through the
masked loop (the rows of a tile see different key ranges), starting at the first key the
tile's first row sees. Non-causal with a window (a cascade group's decode rows against their
shared prefix) needs each row's own query position: `row_offsets[r]` places row r at key
position context_len - 1 + row_offsets[r] (its private length), and a row whose window ends
before the shared keys gets lse -inf. Sinks (gpt-oss) join each row's softmax once it is
complete, as in the decode kernel (decode_attention.join_sink); a cascade's shared part is
launched without them, its decode rows' private part carries them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvbatch.kernels.decode_attention import (
    LOG2E,
    check_attention_inputs,
    check_sinks,
    dot_precision,
    join_sink,
    join_sink_ref,
    merge_split_partials,
    num_sms,
    soft_cap,
)
from kvbatch.kernels.specialize import step_varying

MIN_KEYS_PER_SPLIT = 512  # a split must amortise its q tile load and its partial's write


class PrefillTiles(NamedTuple):
    block_m: int  # (position, head) rows per program
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


def prefill_tiles(dtype: torch.dtype, block_d: int) -> PrefillTiles:
    """Tile and launch settings (Hopper): q tile plus pipelined K/V tiles must fit in shared
    memory, so float32 (tests only) and head_dim 256 get smaller tiles."""
    if dtype.itemsize >= 4:
        return PrefillTiles(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if block_d <= 64:
        return PrefillTiles(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if block_d <= 128:
        return PrefillTiles(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return PrefillTiles(block_m=64, block_n=64, num_warps=4, num_stages=2)


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_base,
    stride_kv,
    table,
    offs_n,
    offs_d,
    d_mask,
    visible,  # [BLOCK_M, BLOCK_N] bool (or [1, BLOCK_N]), used when MASKED
    n_valid,  # [BLOCK_N] bool: key inside the context, used when MASKED
    scale_log2,
    softcap_log2,
    stride_kblk,
    stride_kpos,
    stride_kd,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step of a row tile over the keys offs_n."""
    if MASKED:
        blocks = tl.load(table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_mask = n_valid[:, None] & d_mask[None, :]
    else:
        blocks = tl.load(table + offs_n // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :] & (offs_n[:, None] >= 0)
    slots = blocks * stride_kblk + (offs_n % BLOCK_SIZE) * stride_kpos
    kv_offs = slots[:, None] + offs_d[None, :] * stride_kd  # [BLOCK_N, BLOCK_D]
    k = tl.load(k_base + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # FP8: dequantized
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if SOFTCAP:
        qk = soft_cap(qk, softcap_log2)
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_sub = m_new
    if MASKED:  # a row that has seen no key yet: subtract 0, not -inf (no -inf - -inf = NaN)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_sub[:, None])
    alpha = tl.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(k_base + stride_kv + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@step_varying(
    ints=("stride_tb", "num_splits", "window"),
    pointers=(
        "table_ptr",
        "query_start_ptr",
        "query_lens_ptr",
        "context_lens_ptr",
        "row_offsets_ptr",
    ),
)
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    kv_ptr,  # [2, num_blocks, block_size, KVH, D]
    table_ptr,  # [S, max_blocks]
    query_start_ptr,  # [S]
    query_lens_ptr,  # [S]
    context_lens_ptr,  # [S]
    out_ptr,  # [T, H, D], or the float32 partials [num_splits, T, H, D] when not FINAL
    lse_ptr,  # [T, H] float32 natural log, or the partials' [num_splits, T, H] log2
    scale_log2,  # softmax scale * log2(e) * k_scale
    v_scale,  # 1.0 unless the cache is FP8
    window,  # keys per query in a sliding-window layer; 0: every key
    softcap_log2,  # soft-cap * log2(e), used when SOFTCAP
    row_offsets_ptr,  # [T] non-causal windows: row r's query at context_len - 1 + offset
    sinks_ptr,  # [H] float32 sink logits, read when SINKS (and FINAL)
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kv,
    stride_kblk,
    stride_kpos,
    stride_kh,
    stride_kd,
    stride_tb,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    stride_os,  # partials: split strides (0 when FINAL)
    stride_ls,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    FINAL: tl.constexpr,  # one split: the output and natural-log lse directly
    SOFTCAP: tl.constexpr,
    ROW_OFFSETS: tl.constexpr,  # non-causal with a window: read row_offsets_ptr
    SINKS: tl.constexpr,
):
    tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    query_len = tl.load(query_lens_ptr + seq).to(tl.int32)
    first_row = tile * BLOCK_M
    if first_row >= query_len * G:  # the grid is sized for the longest chunk
        return
    query_start = tl.load(query_start_ptr + seq).to(tl.int64)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)

    offs_m = first_row + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = offs_m // G  # query index within the chunk
    heads = kvh * G + offs_m % G
    m_mask = pos < query_len
    d_mask = offs_d < HEAD_DIM
    rows = query_start + pos
    q = tl.load(
        q_ptr
        + rows[:, None] * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    has_window = (window > 0).to(tl.int32)
    if CAUSAL:
        cached = context_len - query_len
        last_pos = tl.minimum((first_row + BLOCK_M - 1) // G, query_len - 1)
        shared_end = cached + first_row // G + 1  # keys every row of the tile sees
        kv_end = cached + last_pos + 1
        q_abs = cached + pos  # [BLOCK_M] each row's position among the keys
        # the key tile holding the first key the tile's first row sees in its window (0
        # without one): whole tiles, so that a split's tiles never reach into the next split
        lo = has_window * (tl.maximum(cached + first_row // G - window + 1, 0) // BLOCK_N)
        lo = lo * BLOCK_N
    else:
        shared_end = context_len
        kv_end = context_len
        q_abs = tl.zeros([BLOCK_M], tl.int32) + context_len  # no window: unused
        if ROW_OFFSETS:
            offsets = tl.load(row_offsets_ptr + rows, mask=m_mask, other=1).to(tl.int32)
            q_abs = context_len - 1 + offsets
        lo = 0
    unmasked_end = (shared_end // BLOCK_N) * BLOCK_N * (1 - has_window)
    if FINAL:
        keys_start = lo
        keys_end = kv_end
    else:  # this sequence's keys in num_splits ranges of whole key tiles (the last may be
        # short, and a short context leaves some empty: lse -inf, no weight in the merge)
        keys_per_split = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
        keys_start = split * keys_per_split
        keys_end = keys_start + keys_per_split
        keys_start = tl.maximum(keys_start, lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = kv_ptr + kvh * stride_kh
    table = table_ptr + seq.to(tl.int64) * stride_tb
    arange_n = tl.arange(0, BLOCK_N)
    unused = arange_n >= 0  # stands in for the masks where MASKED is off (compiled away)
    for start_n in range(keys_start, tl.minimum(unmasked_end, keys_end), BLOCK_N):
        offs_n = start_n + arange_n
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, stride_kv, table, offs_n, offs_d, d_mask,
            unused[None, :], unused, scale_log2, softcap_log2, stride_kblk, stride_kpos,
            stride_kd, BLOCK_SIZE, PRECISION, False, SOFTCAP,
        )  # fmt: skip
    for start_n in range(
        tl.maximum(unmasked_end, keys_start), tl.minimum(kv_end, keys_end), BLOCK_N
    ):
        offs_n = start_n + arange_n
        n_valid = offs_n < context_len
        visible = n_valid[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= (context_len - query_len + pos)[:, None])
        in_window = offs_n[None, :] > (q_abs - window)[:, None]
        visible = visible & (in_window | (has_window == 0))
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, stride_kv, table, offs_n, offs_d, d_mask,
            visible, n_valid, scale_log2, softcap_log2, stride_kblk, stride_kpos, stride_kd,
            BLOCK_SIZE, PRECISION, True, SOFTCAP,
        )  # fmt: skip

    empty = l_i == 0.0  # no key in range: non-causal with context_len 0, or an empty split
    o = acc * (v_scale / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    if FINAL:
        lse = lse * 0.6931471805599453
        if SINKS:
            o, lse = join_sink(o, lse, tl.load(sinks_ptr + heads, mask=m_mask, other=0.0))
    o_ptrs = out_ptr + split * stride_os + rows[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(
        o_ptrs + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )
    tl.store(lse_ptr + split * stride_ls + rows * stride_lt + heads * stride_lh, lse, mask=m_mask)


@step_varying(ints=("num_splits",), pointers=("query_start_ptr", "query_lens_ptr"))
def _merge_prefill_splits_kernel(
    part_o_ptr,  # [num_splits, T, H, D] float32
    part_lse_ptr,  # [num_splits, T, H] float32, log2 units
    query_start_ptr,
    query_lens_ptr,
    out_ptr,  # [T, H, D]
    lse_ptr,  # [T, H] float32, natural log
    sinks_ptr,  # [H] float32, read when SINKS
    num_splits,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_pls,
    stride_plt,
    stride_plh,
    stride_ot,
    stride_oh,
    stride_od,
    stride_lt,
    stride_lh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINKS: tl.constexpr,
):
    """The split kernel's row tiles again: each merges its rows' partials into `out`."""
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    query_len = tl.load(query_lens_ptr + seq).to(tl.int32)
    if tile * BLOCK_M >= query_len * G:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = offs_m // G
    heads = kvh * G + offs_m % G
    m_mask = pos < query_len
    mask = m_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    rows = tl.load(query_start_ptr + seq).to(tl.int64) + pos
    o, lse = merge_split_partials(
        part_o_ptr + rows[:, None] * stride_pt + heads[:, None] * stride_ph + offs_d[None, :],
        part_lse_ptr + rows * stride_plt + heads * stride_plh,
        stride_ps,
        stride_pls,
        num_splits,
        m_mask,
        mask,
    )
    if SINKS:
        o, lse = join_sink(o, lse, tl.load(sinks_ptr + heads, mask=m_mask, other=0.0))
    tl.store(
        out_ptr
        + rows[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(lse_ptr + rows * stride_lt + heads * stride_lh, lse, mask=m_mask)


def choose_prefill_splits(programs: int, max_context_len: int | None, device: torch.device) -> int:
    """Key splits so that the programs just fill the GPU's resident slots (two per SM: the
    tiles' shared memory allows about two), keeping at least MIN_KEYS_PER_SPLIT keys per split;
    1 when the longest context is not known on the host (cascade groups inside a CUDA graph)
    or the row tiles already fill the GPU.

    Rounded down, not up: one program past the slots starts a second, mostly idle wave, which
    costs about half as much again as the full first one (scripts/prefill_split_bench.py
    times every split count on the device; docs/archive/BENCHMARKS-history.md has its figures)."""
    if not max_context_len:
        return 1
    wanted = 2 * num_sms(device) // max(1, programs)
    useful = max(1, max_context_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, useful, 64))


def auto_prefill_splits(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    max_query_len: int,
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int | None,
    device: torch.device,
) -> int:
    """The split count paged_prefill_attention picks by itself for these shapes (benches and
    tests print or check it)."""
    tiles = prefill_tiles(dtype, max(16, triton.next_power_of_2(head_dim)))
    programs = triton.cdiv(max_query_len * group, tiles.block_m) * num_seqs * num_kv_heads
    return choose_prefill_splits(programs, max_context_len, device)


def paged_prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [S, max_blocks]
    query_start: torch.Tensor,  # [S] first row of each sequence's queries in q
    query_lens: torch.Tensor,  # [S]
    context_lens: torch.Tensor,  # [S] keys attended: cached prefix + own queries
    max_query_len: int,  # host int: sizes the grid
    *,
    causal: bool = True,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    max_context_len: int | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,  # FP8 caches: the stored values times these are K and V
    v_scale: float = 1.0,
    sliding_window: int | None = None,  # keys per query (itself included); None: all
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
    row_offsets: torch.Tensor | None = None,  # [T] non-causal windows (see the module doc)
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits joined to each denominator
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen paged attention of several sequences' query chunks (causal or not).

    Returns out [T, num_heads, head_dim] in q's dtype; only rows covered by a sequence are
    written (rows of `out` outside every sequence keep their contents). With `return_lse` also
    the float32 natural-log log-sum-exp [T, num_heads] (-inf in uncovered rows).
    `max_context_len` (a host int, at least every context_len) lets the keys be split when the
    row tiles alone would leave the GPU idle; `num_splits` sets the count instead (each
    sequence's keys are cut in that many ranges, whatever its length).
    """
    check_attention_inputs(q, kv_cache, q.shape[0], "T")
    if sliding_window is not None and not causal and row_offsets is None:
        raise ValueError(
            "a non-causal sliding window needs row_offsets (each row's query position after "
            "the context): pass the decode rows' private lengths"
        )
    # The kernel indexes these with unit stride (a column slice of a [S, 3] tensor would be
    # read wrongly): no-ops when already contiguous, so still capturable in a CUDA graph.
    block_tables, query_start, query_lens, context_lens = (
        t.contiguous() for t in (block_tables, query_start, query_lens, context_lens)
    )
    num_seqs = block_tables.shape[0]
    if not (query_start.shape[0] == query_lens.shape[0] == context_lens.shape[0] == num_seqs):
        raise ValueError(
            "block_tables, query_start, query_lens and context_lens must have one entry per "
            f"sequence; got {num_seqs}, {query_start.shape[0]}, {query_lens.shape[0]}, "
            f"{context_lens.shape[0]}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    g = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    if num_seqs == 0 or max_query_len <= 0 or num_tokens == 0:
        return (out, lse) if return_lse else out
    sinks_f32 = check_sinks(sinks, num_heads, lse)

    block_d = max(16, triton.next_power_of_2(head_dim))
    tiles = prefill_tiles(q.dtype, block_d)
    row_tiles = triton.cdiv(max_query_len * g, tiles.block_m)
    grid = (row_tiles, num_seqs, num_kv_heads)
    if num_splits is None:
        num_splits = auto_prefill_splits(
            q.dtype, head_dim, g, max_query_len, num_seqs, num_kv_heads, max_context_len, q.device
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    def split_kernel(o, lse_, final: bool) -> None:
        """o [T, H, D] and lse_ [T, H], or the partials with a leading split dimension."""
        o_strides, lse_strides = o.stride()[-3:], lse_.stride()[-2:]
        split_strides = (0, 0) if final else (o.stride(0), lse_.stride(0))
        _prefill_kernel[(row_tiles * num_splits, num_seqs, num_kv_heads)](
            q, kv_cache, block_tables, query_start, query_lens, context_lens, o, lse_,
            scale * LOG2E * k_scale, v_scale, sliding_window or 0, (softcap or 0.0) * LOG2E,
            query_lens if row_offsets is None else row_offsets.contiguous(), sinks_f32, num_splits,
            *q.stride(), *kv_cache.stride(), block_tables.stride(0), *o_strides, *lse_strides,
            *split_strides, G=g, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n, BLOCK_D=block_d, CAUSAL=causal,
            PRECISION=dot_precision(q.dtype), FINAL=final, SOFTCAP=softcap is not None,
            ROW_OFFSETS=row_offsets is not None and not causal, SINKS=sinks is not None,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )  # fmt: skip

    if num_splits == 1:
        split_kernel(out, lse, True)
        return (out, lse) if return_lse else out

    part_o = torch.empty(num_splits, *q.shape, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
    split_kernel(part_o, part_lse, False)
    _merge_prefill_splits_kernel[grid](
        part_o, part_lse, query_start, query_lens, out, lse, sinks_f32, num_splits,
        *part_o.stride()[:3], *part_lse.stride(), *out.stride(), *lse.stride(),
        G=g, HEAD_DIM=head_dim, BLOCK_M=tiles.block_m, BLOCK_D=block_d,
        SINKS=sinks is not None, num_warps=4,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    max_context_len: int | None = None,  # accepted for the same signature; the reference
    num_splits: int | None = None,  # never splits
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    row_offsets: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch varlen paged prefill attention (float32 math, one sequence at a time)."""
    check_attention_inputs(q, kv_cache, q.shape[0], "T")
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    g = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    if out is None:
        out = torch.empty_like(q)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for s, (start, qlen, ctx) in enumerate(
        zip(query_start.tolist(), query_lens.tolist(), context_lens.tolist())
    ):
        if qlen == 0:
            continue
        ids = block_tables[s, : -(-ctx // block_size)].long()
        # [ctx, kv_heads, D] -> [heads, ctx, D]
        keys = kv_cache[0].index_select(0, ids).reshape(-1, num_kv_heads, head_dim)[:ctx]
        values = kv_cache[1].index_select(0, ids).reshape(-1, num_kv_heads, head_dim)[:ctx]
        keys = (keys.float() * k_scale).repeat_interleave(g, dim=1).transpose(0, 1)
        values = (values.float() * v_scale).repeat_interleave(g, dim=1).transpose(0, 1)
        qs = q[start : start + qlen].float().transpose(0, 1)  # [heads, qlen, D]
        scores = torch.matmul(qs, keys.transpose(1, 2)) * scale  # [heads, qlen, ctx]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        k_pos = torch.arange(ctx, device=q.device)
        if causal:
            q_pos = torch.arange(ctx - qlen, ctx, device=q.device)
        elif row_offsets is not None:
            q_pos = ctx - 1 + row_offsets[start : start + qlen].long()
        else:
            q_pos = torch.full((qlen,), ctx, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None] if causal else k_pos[None, :] >= 0
        if sliding_window is not None:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [heads, qlen]
        probs = torch.exp(scores - row_lse.nan_to_num(neginf=0.0)[..., None])
        rows_out, rows_lse = join_sink_ref(
            torch.matmul(probs, values).transpose(0, 1), row_lse.transpose(0, 1), sinks
        )
        out[start : start + qlen] = rows_out.to(out.dtype)
        lse[start : start + qlen] = rows_lse
    return (out, lse) if return_lse else out

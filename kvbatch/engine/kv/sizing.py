"""How many blocks the KV pool gets, the context length that fits it, and the startup lines
that say so.

    budget   = kv_cache_bytes | profiled on CUDA (kv/memory.py) | DEFAULT_CPU_KV_BYTES
    blocks   = budget // bytes of one block (the draft model's KV counted in), or num_kv_blocks,
               capped by what a default budget can put to use
    max_model_len = the one asked for (refused when one request of it would not fit), else the
               longest request the caller will send (a job's) or the model's context, capped
               at the model's and at what the pool holds (said once in the log)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvbatch.engine.core.config import DEFAULT_CPU_KV_BYTES, CacheConfig, SchedulerConfig
from kvbatch.engine.exec.runner import kv_bytes_per_block
from kvbatch.engine.kv.layout import KVLayout
from kvbatch.engine.kv.memory import (
    KV_POOL_REQUESTS_PER_SEQ,
    cuda_kv_budget,
    kv_blocks_worth_having,
    profile_peak_activation_bytes,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVPoolRequest:
    """What sizing the pool reads: the settings, the model (and draft) whose KV it holds, the
    device, and the longest request it must hold."""

    cache: CacheConfig
    scheduler: SchedulerConfig  # max_num_batched_tokens resolved
    model: torch.nn.Module
    forward: object  # the step function profiled on CUDA (the model itself)
    backend: object
    device: torch.device
    kv_dtype: torch.dtype
    model_dtype: torch.dtype
    max_model_len: int
    draft_model: torch.nn.Module | None = None
    layout: KVLayout | None = None  # window groups (engine/kv/layout.py), when hybrid


def kv_pool_blocks(req: KVPoolRequest) -> int:
    """Blocks of the KV pool (and of the draft model's, which has as many): the budget divided
    by what one block costs, both models' KV together."""
    cache = req.cache
    warn_unused_fraction(cache, req.device)
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    layout = req.layout if req.layout is not None and req.layout.is_hybrid else None
    per_block = kv_bytes_per_block(req.model, cache.block_size, req.kv_dtype, layout)
    if req.draft_model is not None:
        per_block += kv_bytes_per_block(req.draft_model, cache.block_size, req.model_dtype)
    blocks = max(0, _budget_bytes(req) // per_block)
    if cache.kv_cache_bytes is None:  # a default budget: no more than can be put to use
        per_seq = req.max_model_len
        if layout is not None:  # what one request holds, in block_size tokens' worth
            held = layout.blocks_per_seq(
                req.max_model_len, cache.block_size, req.scheduler.max_num_batched_tokens
            )
            per_seq = held * cache.block_size
        most = kv_blocks_worth_having(req.scheduler.max_num_seqs, per_seq, cache.block_size)
        if blocks > most:
            log.info(
                "KV pool capped at %d blocks (%d x max_num_seqs=%d requests of "
                "max_model_len=%d) instead of the %d the budget allows",
                most,
                KV_POOL_REQUESTS_PER_SEQ,
                req.scheduler.max_num_seqs,
                req.max_model_len,
                blocks,
            )
            blocks = most
    return blocks


def _budget_bytes(req: KVPoolRequest) -> int:
    cache = req.cache
    if cache.kv_cache_bytes is not None:
        return cache.kv_cache_bytes
    if req.device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES
    scheduler = req.scheduler
    peak = profile_peak_activation_bytes(
        req.model,
        req.forward,
        req.backend,
        num_tokens=scheduler.max_num_batched_tokens,
        max_model_len=req.max_model_len,
        max_num_seqs=scheduler.max_num_seqs,
        block_size=cache.block_size,
        dtype=req.kv_dtype,
        device=req.device,
    )
    budget = cuda_kv_budget(peak, cache.kv_cache_memory_fraction, req.device)
    log.info(
        "profiled the largest step (%d tokens): %.2f GiB of activations; KV pool "
        "%.2f GiB (kv_cache_memory_fraction=%.2f of what is left)",
        scheduler.max_num_batched_tokens,
        peak / 2**30,
        budget / 2**30,
        cache.kv_cache_memory_fraction,
    )
    return budget


def warn_unused_fraction(cache: CacheConfig, device: torch.device) -> None:
    """A kv_cache_memory_fraction asked for but not used says so (a user tuning it on the
    CPU, or beside an explicit pool size, would otherwise see no change and no reason)."""
    if cache.kv_cache_memory_fraction == CacheConfig.kv_cache_memory_fraction:
        return
    if cache.num_kv_blocks is not None:
        why = "num_kv_blocks sets the pool"
    elif cache.kv_cache_bytes is not None:
        why = "kv_cache_bytes sets the pool"
    elif device.type != "cuda":
        why = (
            f"it sizes the pool on CUDA only; on {device} kv_cache_bytes does "
            f"(default {DEFAULT_CPU_KV_BYTES >> 20} MiB)"
        )
    else:
        return
    log.warning("kv_cache_memory_fraction=%g is not used: %s", cache.kv_cache_memory_fraction, why)


def fitted_max_model_len(
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    *,
    asked: bool,
    draft: bool = False,
    layout: KVLayout | None = None,
    max_chunk: int = 0,
    wanted: str = "the model's context",
) -> int:
    """The context length the pool can serve. One asked for (`asked`) must fit whole: a pool
    too small is refused, naming what to raise or lower. One the engine chose (`wanted` says
    which: the model's context, or a job's longest request) is instead capped at what the pool
    holds, and the log says so once. With window groups a request holds all its blocks in
    group 0 but only its window's (and a chunk's) in the others."""
    if layout is not None and layout.is_hybrid:
        pool_tokens = layout.max_tokens_held(num_blocks, block_size, max_chunk, max_model_len)
    else:
        pool_tokens = num_blocks * block_size
    if pool_tokens >= max_model_len:
        return max_model_len
    if asked or pool_tokens < 2:
        shared = " (the budget pays for the draft model's KV too)" if draft else ""
        raise ValueError(
            f"the KV cache holds {pool_tokens} tokens ({num_blocks} blocks "
            f"of {block_size}){shared} but one request may need max_model_len="
            f"{max_model_len}: raise kv_cache_bytes (or num_kv_blocks, or "
            "kv_cache_memory_fraction on CUDA) or lower max_model_len"
        )
    log.info(
        "max_model_len=%d: %s of %d does not fit the KV cache (%d tokens), "
        "so requests are capped at what it holds; for longer ones set max_model_len "
        "(--max-model-len) and a kv_cache_bytes (--kv-cache-bytes) that holds it",
        pool_tokens,
        wanted,
        max_model_len,
        pool_tokens,
    )
    return pool_tokens


def log_kv_pool(
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    max_model_len: int,
    max_num_seqs: int,
    why: str = "",
    layout: KVLayout | None = None,
    max_chunk: int = 0,
    bytes_per_token: int = 0,
) -> None:
    """The startup line: how much the pool holds, at how many bytes per token (every KV
    layer's K and V, or an MLA layer's latent), the context length and `why` it is that, and
    what that means for requests at once; with window groups, a line per group first."""
    kv_tokens = num_blocks * block_size
    at_once = requests_at_once(kv_tokens, max_model_len, max_num_seqs)
    if layout is not None and layout.is_hybrid:
        log_kv_groups(num_blocks, block_size, layout, max_model_len, max_chunk)
        at_once = requests_at_once(
            kv_tokens,
            max_model_len,
            max_num_seqs,
            blocks_per_request=lambda n: layout.blocks_per_seq(n, block_size, max_chunk),
            num_blocks=num_blocks,
        )
    log.info(
        "KV cache (%s): %d tokens (%d blocks of %d)%s, max_model_len=%d%s; shared by the "
        "requests running at once: prompt + answer tokens of all of them must fit, so %s; "
        "requests beyond that wait their turn (shared prefixes are stored once)",
        str(kv_dtype).removeprefix("torch."),
        kv_tokens,
        num_blocks,
        block_size,
        f", {bytes_per_token:,} bytes per token" if bytes_per_token else "",
        max_model_len,
        f" ({why})" if why else "",
        at_once,
    )


def requests_at_once(
    kv_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    blocks_per_request: Callable[[int], int] | None = None,
    num_blocks: int = 0,
) -> str:
    """How many requests fit the pool, in words: of a typical 1,000 tokens, and of the
    whole max_model_len. With window groups a request of n tokens holds
    blocks_per_request(n) of the pool's num_blocks (less than n tokens' worth)."""

    def fit(n: int) -> float:
        if blocks_per_request is None:
            return kv_tokens / n
        return num_blocks / max(blocks_per_request(n), 1)

    longest = f"{fit(max_model_len):.1f}".removesuffix(".0")
    whole = f"even if each used the whole max_model_len ({max_model_len})"
    if max_model_len <= 1000:
        return f"at least {longest} run together {whole}"
    typical = min(int(fit(1000)), max_num_seqs)
    noun, verb = ("request", "runs") if typical == 1 else ("requests", "run")
    return f"about {typical} {noun} of 1,000 tokens {verb} together, and at least {longest} {whole}"


def log_kv_groups(
    num_blocks: int, block_size: int, layout: KVLayout, max_model_len: int, max_chunk: int
) -> None:
    """One line per KV group: its layers, whether it keeps every block or its window's, and
    what one request of max_model_len tokens holds in it."""
    for i, group in enumerate(layout.groups):
        kind = (
            "keeps every block"
            if group.window is None
            else f"frees blocks {group.window} tokens behind the newest"
        )
        held = group.blocks_per_seq(max_model_len, block_size, max_chunk)
        where = (
            f"{held} blocks per request of max_model_len={max_model_len}"
            if group.layers
            else "prefix identities only, no KV"
        )
        log.info(
            "KV group %d (%s, layers %s): %s; %s (pool: %d blocks of %d tokens x %d layers)",
            i,
            group.label,
            ",".join(map(str, group.layers)) or "none",
            kind,
            where,
            num_blocks,
            block_size,
            layout.num_slots,
        )

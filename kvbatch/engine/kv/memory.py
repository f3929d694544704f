"""How much GPU memory the KV pool may take: profile the worst step, then share what is left.

    free after loading weights
      - peak activations of the largest step (max_num_batched_tokens tokens, profiled)
      = what is left;  kv_cache_memory_fraction of it becomes the block pool

The profile runs one real forward of the step the scheduler can build at its largest (a full
token budget of prefill, split into sequences no longer than max_model_len, and logits for
max_num_seqs rows) on a throw-away cache just big enough for it, and measures the allocator's
peak above the weights. The fraction leaves room for CUDA graphs, the sampler's temporaries
and fragmentation.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from kvbatch.engine.attention.metadata import AttentionMetadata, PrefillSpan
from kvbatch.engine.kv.layer_tensors import layer_kv_tensors


@dataclass
class ProfileStep:
    """The largest step the scheduler can build, on a throw-away cache just big enough."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    kv_caches: list[torch.Tensor]
    meta: AttentionMetadata
    logits_rows: torch.Tensor


def largest_step(
    model,
    *,
    num_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    dtype: torch.dtype,  # the KV pool's (kv_cache_dtype)
    device: torch.device,
) -> ProfileStep:
    """A full token budget of prefill, in sequences no longer than max_model_len - 1, with
    logits for max_num_seqs rows."""
    cfg = model.config
    num_blocks = -(-num_tokens // block_size) + 1
    caches = layer_kv_tensors(cfg, None, num_blocks, block_size, dtype, device)
    spans, positions, slots, start, block = [], [], [], 0, 0
    while start < num_tokens:
        n = min(max_model_len - 1, num_tokens - start)
        blocks = torch.arange(block, block + -(-n // block_size), device=device)
        spans.append(PrefillSpan(start, n, n, blocks))
        pos = torch.arange(n, device=device)
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        start, block = start + n, block + len(blocks)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 1, dtype=torch.long, device=device),
        decode_seq_lens=torch.zeros(0, dtype=torch.long, device=device),
        prefills=spans,
    )
    rows = torch.arange(num_tokens - min(max_num_seqs, num_tokens), num_tokens, device=device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    return ProfileStep(ids, torch.cat(positions), caches, meta, rows)


def run_step(forward, backend, step: ProfileStep) -> torch.Tensor:
    logits = forward(
        step.input_ids,
        step.positions,
        step.kv_caches,
        step.meta,
        backend,
        logits_indices=step.logits_rows,
    )
    return torch.softmax(logits, dim=-1)  # the sampler's largest temporary


def profile_peak_activation_bytes(model, forward, backend, **step_args) -> int:
    """Bytes the largest step needs above the weights (CUDA: measured by the allocator)."""
    device = step_args["device"]
    # An engine the caller has dropped can still hold its KV pool (about all free memory):
    # engines sit in reference cycles (runner <-> backend, CUDA graph closures) that only the
    # cycle collector frees. Collect now, so the second LLM in a process (tests, notebooks)
    # shares out memory that is really free instead of failing to allocate the profile step.
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    step = largest_step(model, **step_args)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)  # weights + the throw-away cache
    probs = run_step(forward, backend, step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del probs, step
    torch.cuda.empty_cache()
    return max(0, peak)


def cuda_kv_budget(peak_activation: int, fraction: float, device: torch.device) -> int:
    """kv_cache_memory_fraction of the memory left once the largest step's activations are
    set aside."""
    free, _total = torch.cuda.mem_get_info(device)
    return max(0, int((free - peak_activation) * fraction))


# Blocks past this many full-length requests' worth can only keep prefix-cache entries of
# requests no longer running; the block manager's bookkeeping is per block (Python objects),
# so a tiny model on a big GPU (0.9 of an H200 is 15 million blocks of a test model) would
# spend seconds and gigabytes of host memory on blocks it never uses.
KV_POOL_REQUESTS_PER_SEQ = 4


def kv_blocks_worth_having(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most blocks a default budget gets: KV_POOL_REQUESTS_PER_SEQ x max_num_seqs requests
    of max_model_len tokens (a 1B model with 128k context on an H200 is far below it; an
    explicit kv_cache_bytes or num_kv_blocks is never capped)."""
    return KV_POOL_REQUESTS_PER_SEQ * max_num_seqs * -(-max_model_len // block_size)

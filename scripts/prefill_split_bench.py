"""Times the prefill kernel on one short chunk after a long context, at several key-split counts.

The long-prefill shape (a 32k prompt prefilled in chunks while others decode): a chunk of C
tokens attends to the whole cached prefix, and with few row tiles the kernel splits the keys
(kernels/prefill_attention.choose_prefill_splits). This prints, per chunk length, the time at
each forced split count and at the automatic choice, and each result's largest difference from
the unsplit output, so one GPU run says whether the automatic choice is near the best one.

    python scripts/prefill_split_bench.py                      # CUDA, bfloat16, 32k context
    python scripts/prefill_split_bench.py --device cpu --context 300 --chunks 16 --splits 1,2
        # (the Triton interpreter: a correctness smoke run; its times mean nothing)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--context", type=int, default=32768, help="keys each chunk attends to")
    p.add_argument("--chunks", default="128,256,512,2048", help="chunk lengths (query tokens)")
    p.add_argument("--splits", default="1,2,4,8,16,32", help="forced split counts to time")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per kv head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    return p.parse_args(argv)


# Largest difference allowed between a split and the unsplit output: the same float32 softmax
# arithmetic in another order, rounded once to the output dtype.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def time_call(fn, device) -> float:
    """Milliseconds per call: triton's do_bench on CUDA, one timed call on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=30))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from kernels.prefill_attention import (
        choose_prefill_splits,
        paged_prefill_attention,
        prefill_tiles,
    )

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    g = torch.Generator().manual_seed(0)
    num_blocks = -(-args.context // args.block_size)
    shape = (2, num_blocks, args.block_size, args.kv_heads, args.head_dim)
    kv_cache = torch.randn(shape, generator=g).to(device, dtype)
    table = torch.randperm(num_blocks, generator=g).to(device, torch.int32)[None, :]
    heads = args.kv_heads * args.group
    tolerance = TOLERANCE[str(dtype).removeprefix("torch.")]
    block_m = prefill_tiles(dtype, max(16, 1 << (args.head_dim - 1).bit_length())).block_m
    worst = 0.0
    print(
        f"prefill kernel, one chunk after a {args.context}-token context: {heads} heads, "
        f"{args.kv_heads} kv heads, head_dim {args.head_dim}, {dtype}, {device}"
    )
    print("chunk  splits        ms  max |diff| vs 1 split")
    for chunk in ints(args.chunks):
        q = torch.randn(chunk, heads, args.head_dim, generator=g).to(device, dtype)
        meta = [torch.tensor([x], device=device) for x in (0, chunk, args.context)]

        def run(splits: int | None, q=q, meta=meta, chunk=chunk):
            return paged_prefill_attention(
                q, kv_cache, table, *meta, chunk, max_context_len=args.context, num_splits=splits
            )

        base = run(1)
        programs = -(-chunk * args.group // block_m) * args.kv_heads
        auto = choose_prefill_splits(programs, args.context, device)
        for splits in [*ints(args.splits), None]:
            diff = (run(splits).float() - base.float()).abs().max().item()
            worst = max(worst, diff)
            label = f"auto {auto}" if splits is None else str(splits)
            ms = time_call(lambda s=splits: run(s), device)
            print(f"{chunk:>5}  {label:>6}  {ms:>8.3f}  {diff:.2e}")
    verdict = "ok" if worst <= tolerance else "FAIL"
    print(
        f"prefill splits {verdict}: split outputs within {worst:.2e} of unsplit (tolerance {tolerance:.0e})"
    )
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())

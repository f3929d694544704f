"""Times the prefill kernel on one short chunk after a long context, at several key-split counts.

The long-prefill shape (a 32k prompt prefilled in chunks while others decode): a chunk of C
tokens attends to the whole cached prefix, and with few row tiles the kernel splits the keys
(kernels/prefill_attention.choose_prefill_splits). This prints, per chunk length, the time at
each forced split count and at the automatic choice, and each result's largest difference from
the unsplit output, so one GPU run says whether the automatic choice is near the best one.
Then the cascade shape of `rag` (16 groups of 16 decoding rows against a 1024-token shared
document, not causal), which the engine runs unsplit today: whether splitting it would pay.

    python scripts/prefill_split_bench.py                      # CUDA, bfloat16, 32k context
    python scripts/prefill_split_bench.py --device cpu --context 300 --chunks 16 --splits 1,2
        # (the Triton interpreter: a correctness smoke run; its times mean nothing)
"""

from __future__ import annotations

import argparse
import os
import time


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
    p.add_argument("--cascade-groups", type=int, default=16, help="0: no cascade table")
    p.add_argument("--cascade-rows", type=int, default=16, help="decode rows per group")
    p.add_argument("--cascade-keys", type=int, default=1024, help="shared keys per group")
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


def time_splits(label: str, run, counts: list[int], auto: int, device) -> float:
    """One table row per split count (and the automatic choice, `run(None)`): ms per call and
    the largest difference from the unsplit output. Returns the largest difference."""
    base = run(1).float()
    worst = 0.0
    for splits in [*counts, None]:
        diff = (run(splits).float() - base).abs().max().item()
        worst = max(worst, diff)
        name = f"auto {auto}" if splits is None else str(splits)
        ms = time_call(lambda s=splits: run(s), device)
        print(f"{label:>7}  {name:>6}  {ms:>8.3f}  {diff:.2e}")
    return worst


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from kvbatch.kernels.prefill_attention import auto_prefill_splits, paged_prefill_attention

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    g = torch.Generator().manual_seed(0)
    groups, rows, shared = args.cascade_groups, args.cascade_rows, args.cascade_keys
    bs = args.block_size
    num_blocks = -(-args.context // bs) + groups * -(-shared // bs)
    shape = (2, num_blocks, bs, args.kv_heads, args.head_dim)
    kv_cache = torch.randn(shape, generator=g).to(device, dtype)
    blocks = torch.randperm(num_blocks, generator=g).to(device, torch.int32)
    heads = args.kv_heads * args.group
    tolerance = TOLERANCE[str(dtype).removeprefix("torch.")]
    counts = ints(args.splits)
    worst = 0.0
    print(
        f"prefill kernel: {heads} heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
        f"{dtype}, {device}; ms per call (one layer)"
    )
    print(f"one chunk after a {args.context}-token context (causal):")
    print("  chunk  splits        ms  max |diff| vs 1 split")
    table = blocks[: -(-args.context // bs)][None, :]
    for chunk in ints(args.chunks):
        q = torch.randn(chunk, heads, args.head_dim, generator=g).to(device, dtype)
        meta = [torch.tensor([x], device=device) for x in (0, chunk, args.context)]

        def run(splits: int | None, q=q, meta=meta, chunk=chunk):
            return paged_prefill_attention(
                q, kv_cache, table, *meta, chunk, max_context_len=args.context, num_splits=splits
            )

        dims = (dtype, args.head_dim, args.group, chunk, 1, args.kv_heads)
        auto = auto_prefill_splits(*dims, args.context, device)
        worst = max(worst, time_splits(str(chunk), run, counts, auto, device))

    if groups:  # the cascade shape: each group's decode rows against its shared prefix
        print(
            f"cascade: {groups} groups x {rows} decode rows against {shared} shared keys each "
            "(not causal; in CUDA graphs today unsplit):"
        )
        print("  group  splits        ms  max |diff| vs 1 split")
        width = -(-shared // bs)
        tables = blocks[-groups * width :].reshape(groups, width)
        q = torch.randn(groups * rows, heads, args.head_dim, generator=g).to(device, dtype)
        starts = torch.arange(groups, device=device) * rows
        lens = [torch.full((groups,), n, device=device) for n in (rows, shared)]

        def run_groups(splits: int | None):
            return paged_prefill_attention(
                q, kv_cache, tables, starts, *lens, rows, causal=False,
                max_context_len=shared, num_splits=splits,
            )  # fmt: skip

        dims = (dtype, args.head_dim, args.group, rows, groups, args.kv_heads)
        auto = auto_prefill_splits(*dims, shared, device)
        worst = max(worst, time_splits(f"{rows}x{shared}", run_groups, counts, auto, device))

    verdict = "ok" if worst <= tolerance else "FAIL"
    print(
        f"prefill splits {verdict}: split outputs within {worst:.2e} of unsplit "
        f"(tolerance {tolerance:.0e})"
    )
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())

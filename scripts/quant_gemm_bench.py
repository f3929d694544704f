"""Times the quantized GEMMs against the plain one on a model's linear shapes, batch by batch.

For each weight shape (default: Llama-3.1-8B's qkv, o, gate_up and down projections, random
weights) and each batch M, one row per method, in ms per call and as a speed-up over the
activation-dtype GEMM (F.linear), with each result's error against the float GEMM of the same
quantized weights (a wrong kernel shows as a large error, not only as a slow one):

    dense     F.linear(x, w) in the activation dtype: the baseline
    w4a16     kernels/wna16_gemm.py, 4-bit, group 128, split-K chosen by shape
    w4-deq    the same weights dequantized to the activation dtype, then F.linear (what a
              large batch may prefer: the dequantization is paid once per call)
    fp8       quantize_fp8_per_token(x) + fp8_scaled_mm (per-channel weight scales)
    int8      quantize_int8_per_token(x) + int8_scaled_mm

    python scripts/quant_gemm_bench.py                          # CUDA, bfloat16
    python scripts/quant_gemm_bench.py --device cpu --shapes 256x128 --batches 1,5
        # (the Triton interpreter: a correctness smoke run; its times mean nothing)

The kernels are imported inside the functions, once main has set TRITON_INTERPRET for a CPU
run: Triton reads it when a kernel module is imported.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Llama-3.1-8B: hidden 4096, 32 heads + 8 kv heads of 128, intermediate 14336 (K x N).
LLAMA_8B_SHAPES = "4096x6144,4096x4096,4096x28672,14336x4096"
METHODS = ("dense", "w4a16", "w4-deq", "fp8", "int8")
# Largest error allowed against the float GEMM of the same quantized weights (relative to
# the output's largest magnitude): rounding of x to fp8/int8 and of the output dtype.
TOLERANCE = {"dense": 1e-2, "w4a16": 1e-2, "w4-deq": 1e-2, "fp8": 0.1, "int8": 0.05}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--shapes", default=LLAMA_8B_SHAPES, help="KxN weight shapes, comma-separated")
    p.add_argument("--batches", default="1,2,4,8,16,64,256,1024", help="M values")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--methods", default=",".join(METHODS))
    return p.parse_args(argv)


def time_call(fn, device) -> float:
    """Milliseconds per call: triton's do_bench on CUDA, one timed call on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=30))
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def quantized_weights(K: int, N: int, group_size: int, dtype, device, gen):
    """One random weight in every format, and each format's float image (what its GEMM should
    compute with): {method: (operands, float weight [N, K])}."""
    import torch

    from kvbatch.kernels.fp8_gemm import FP8_DTYPE, FP8_MAX
    from kvbatch.kernels.wna16_gemm import dequantize_wna16, pack_qweight

    w = (torch.randn(N, K, generator=gen) * 0.02).to(device)
    groups = -(-K // group_size)
    q4 = torch.randint(0, 16, (K, N), generator=gen).to(device)
    s4 = (torch.rand(groups, N, generator=gen) * 0.004 + 0.001).to(device=device, dtype=dtype)
    z4 = torch.full((groups, N), 8.0, device=device, dtype=dtype)
    qweight = pack_qweight(q4, 4)
    w4 = dequantize_wna16(qweight, s4, z4, None, group_size, 4, K)  # [K, N] float32
    fp8_scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    w_fp8 = (w / fp8_scale).to(FP8_DTYPE)
    int8_scale = w.abs().amax(dim=1, keepdim=True) / 127
    w_int8 = torch.round(w / int8_scale).to(torch.int8)
    return {
        "dense": (w.to(dtype), w.to(dtype).float()),
        "w4a16": ((qweight, s4, z4), w4.T.to(dtype).float()),
        "w4-deq": ((qweight, s4, z4), w4.T.to(dtype).float()),
        "fp8": ((w_fp8, fp8_scale), w_fp8.float() * fp8_scale),
        "int8": ((w_int8, int8_scale), w_int8.float() * int8_scale),
    }


def gemm(method: str, operands, dtype, group_size: int):
    """A call x -> [M, N] of the method on its operands."""
    import torch.nn.functional as F

    from kvbatch.kernels.fp8_gemm import fp8_scaled_mm, quantize_fp8_per_token
    from kvbatch.kernels.int8_gemm import int8_scaled_mm, quantize_int8_per_token
    from kvbatch.kernels.wna16_gemm import dequantize_wna16, wna16_gemm

    if method == "dense":
        return lambda x: F.linear(x, operands)
    if method == "w4a16":
        qweight, s, z = operands
        return lambda x: wna16_gemm(x, qweight, s, z, None, group_size, 4)
    if method == "w4-deq":
        qweight, s, z = operands

        def dequant_then_gemm(x):
            w = dequantize_wna16(qweight, s, z, None, group_size, 4, x.shape[1]).to(dtype)
            return x @ w

        return dequant_then_gemm
    if method == "fp8":
        w, scale = operands

        def fp8(x):
            xq, xs = quantize_fp8_per_token(x)
            return fp8_scaled_mm(xq, xs, w, scale, dtype)

        return fp8
    w, scale = operands

    def int8(x):
        xq, xs = quantize_int8_per_token(x)
        return int8_scaled_mm(xq, xs, w, scale, dtype)

    return int8


def fused_up_to(times: dict[int, dict[str, float]]) -> int | None:
    """The largest batch M up to which the fused W4A16 kernel is at least as fast as
    dequantize-then-GEMM at every measured M (None: slower already at the smallest)."""
    best = None
    for M in sorted(times):
        t = times[M]
        if "w4a16" not in t or "w4-deq" not in t or t["w4a16"] > t["w4-deq"]:
            break
        best = M
    return best


def crossover_lines(w4_times: dict[str, dict[int, dict[str, float]]]) -> list[str]:
    """Per shape, where the fused kernel stops winning, and the value for
    engine/quant/gemm.py's WNA16_KERNEL_MAX_BATCH (the smallest over the shapes)."""
    limits = {shape: fused_up_to(times) for shape, times in w4_times.items() if times}
    if not limits:
        return []
    lines = [
        f"w4a16 {shape}: fused kernel as fast as dequantize-then-GEMM up to M = {limit}"
        if limit is not None
        else f"w4a16 {shape}: dequantize-then-GEMM faster already at M = {min(w4_times[shape])}"
        for shape, limit in limits.items()
    ]
    known = [v for v in limits.values() if v is not None]
    suggestion = min(known) if len(known) == len(limits) else 0
    lines.append(f"WNA16_KERNEL_MAX_BATCH from these shapes: {suggestion}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    if device.type == "cpu":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        print(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
        return 2
    gen = torch.Generator().manual_seed(0)
    print(f"device {device}, activations {dtype}, 4-bit group {args.group_size}")
    print(f"{'K x N':>12}  {'M':>5}  {'method':>7}  {'ms':>9}  {'vs dense':>8}  {'error':>8}")
    failed = []
    w4_times: dict[str, dict[int, dict[str, float]]] = {}  # shape -> M -> method -> ms
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        weights = quantized_weights(K, N, args.group_size, dtype, device, gen)
        for M in (int(b) for b in args.batches.split(",")):
            x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
            dense_ms = None
            for method in methods:
                operands, w_float = weights[method]
                run = gemm(method, operands, dtype, args.group_size)
                exact = x.float() @ w_float.T
                error = ((run(x).float() - exact).abs().max() / exact.abs().max()).item()
                ms = time_call(lambda run=run, x=x: run(x), device)
                dense_ms = ms if method == "dense" else dense_ms
                if method in ("w4a16", "w4-deq"):
                    w4_times.setdefault(shape, {}).setdefault(M, {})[method] = ms
                ratio = f"{dense_ms / ms:7.2f}x" if dense_ms else "-"
                print(f"{shape:>12}  {M:>5}  {method:>7}  {ms:>9.4f}  {ratio:>8}  {error:.2e}")
                if not error <= TOLERANCE[method]:
                    failed.append(f"{method} {shape} M={M}: error {error:.2e}")
    for line in crossover_lines(w4_times):
        print(line)
    if failed:
        print("errors past tolerance:\n  " + "\n  ".join(failed))
        return 1
    print("quantized GEMMs ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

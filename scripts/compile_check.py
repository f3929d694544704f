"""Compile every Triton kernel the engine launches for an H200 (sm_90), on a machine without
a GPU: compile errors, shared memory and register spills show up before any GPU time is spent.

    python scripts/compile_check.py [--arch 90] [--dtypes bfloat16,float32] [--json FILE]
                                    [--models llama,moe,gemma,quantized,gpt-oss]

Triton ships ptxas, so the whole chain (Python -> TTIR -> TTGIR -> LLVM -> PTX -> cubin) runs on
the CPU once the runtime is told the target instead of asking a driver. This script puts a
compile-only driver in place and turns every launch into a compile (`warmup`), then drives the
engine's own GPU path on the CPU: the model's layers on their Triton kernels (engine/layers/)
and the triton attention backend of a one-layer model of `rag`'s shape (hidden 2048, 32 heads, 8 KV heads, head dim 64,
ffn 8192, llama3 rope), through a scheduler and the model runner over shared-prefix requests,
chunked prefill and the padded decode-graph path, so each kernel is compiled with exactly the
constexprs and argument specialisations the engine gives it. `--models` adds the other GPU
paths, each one layer of a real shape: `moe` (Qwen3-30B-A3B's expert shapes, 16 of its
experts: float, W4A16, online FP8 and block-FP8 experts in the fused MoE kernels), `gemma`
(Gemma 3 1B's shapes on Gemma's layers), `quantized` (rag's layer with W4A16, online
FP8 and block-FP8 projections on kvbatch.kernels' GEMMs) and `gpt-oss` (gpt-oss-20b's shapes:
sink attention, MXFP4 experts). Outputs are never computed (the
torch ops between kernels run on the CPU on uninitialised data).

For each compiled kernel: shared memory (from Triton's metadata; must fit the 227 KiB an
sm_90 block may use), registers and spill bytes (ptxas -v on its PTX). Then eager steps whose
sizes vary as a job's do: each kernel must compile once per set of its constexprs and pointer
types, since a variant for an argument's alignment or divisibility is a compile in the middle
of a run on the GPU (kernels/specialize.py). Exit status 1 when a kernel fails to compile,
overflows shared memory or compiles more variants than that; spills are reported, not fatal.
Run it under the GPU machine's Triton (3.6) too: that is the version that will compile there.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # real compiles, before anything imports kernels/

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import jit as triton_jit  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

SM90_MAX_SHARED = 232_448  # bytes of shared memory one block may opt into on sm_90 (227 KiB)


class CompileOnlyDriver:
    """What Triton's JIT asks of a driver before launching, with a fixed target."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def record_compiles(arch: int) -> list[tuple[str, object, object]]:
    """From now on every kernel launch compiles for `arch` and returns without running; each
    launch appends (kernel name, its JITFunction, the compiled kernel)."""
    driver.set_active(CompileOnlyDriver(arch))
    compiled: list[tuple[str, object, object]] = []
    run = triton_jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, self, kernel))
        return kernel

    triton_jit.JITFunction.run = compile_only
    return compiled


def rag_shaped_model(dtype: torch.dtype):
    """One layer of Llama-3.2-1B's shape (bench/models.py), uninitialised, built like
    engine/model/loader.py builds a model. The vocabulary is cut to 2048: it only sizes GEMMs and
    the sampler, no kernel."""
    import dataclasses

    from kvbatch.bench.models import LLAMA_3_2_1B
    from kvbatch.engine.layers.linear import merge_projections
    from kvbatch.engine.models.llama import LlamaForCausalLM, ModelConfig

    spec = dataclasses.replace(LLAMA_3_2_1B, num_hidden_layers=1, vocab_size=2048)
    cfg = ModelConfig.from_hf(spec.config())
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.rebuild_rotary(torch.device("cpu"))  # float32 frequencies, as the loader builds them
    return merge_projections(model)


def drive_engine(dtype: torch.dtype) -> None:
    """The engine's GPU path on the CPU: a scheduler, the runner, the triton backend."""
    model = rag_shaped_model(dtype)
    docs = [[100 + i] * 40 for i in range(2)]  # two documents of 2.5 blocks, 3 chunks each
    prompts = [doc + [7 + j] * (5 + j) for doc in docs for j in range(3)]
    prompts.append(list(range(3, 303)))  # a 300-token prompt: chunked over two steps
    # prefill chunks, cascade decode steps, plain decodes
    runner = run_steps(model, dtype, prompts, [4] * len(prompts), max_num_batched_tokens=256)

    # The graph path: static buffers sized for a bucket, with and without groups, and with
    # a prompt chunk after the decodes (its keys split for the longest context).
    from kvbatch.engine.exec.cuda_graphs import GraphKey

    runner.capture_step_graphs(max_batch=8, max_model_len=4096, max_chunk=32, capture=False)
    graphs = runner.step_graphs
    for key in graphs.keys + [GraphKey(2, False, 16), GraphKey(8, True, 32)]:
        graphs._run(key)

    # Eager steps whose sizes vary step to step, as a job's do: a long prompt's chunks beside
    # decodes that share a document or not, under token budgets that give odd chunks. Each
    # kernel should compile once per set of constexprs (kernels/specialize.py), not once
    # per alignment or divisibility its per-step arguments happen to have.
    doc = [11] * 70
    for budget, decoders, long_len, shared in ((61, 5, 1500, False), (97, 9, 2100, True)):
        prompts = [(doc if shared else []) + [3 + i] * (7 + 5 * i) for i in range(decoders)]
        prompts.append([5 + i % 2000 for i in range(long_len)])  # (the vocabulary is cut)
        lens = [30 + i for i in range(decoders)] + [3]
        run_steps(model, dtype, prompts, lens, max_num_batched_tokens=budget)


def drive_moe(dtype: torch.dtype, cache: Path) -> None:
    """One layer of Qwen3-30B-A3B's shapes with 16 of its 128 experts (per-expert shapes and
    top 8 as released), its experts float, W4A16, online FP8 and block FP8."""
    import dataclasses

    from kvbatch.bench.models import QWEN3_30B_A3B_4_LAYERS

    spec = dataclasses.replace(
        QWEN3_30B_A3B_4_LAYERS, num_hidden_layers=1, num_experts=16, vocab_size=2048
    )
    for weights, quantization in (("float", None), ("w4a16", None), ("float", "fp8")):
        drive_random_model(spec, weights, quantization, dtype, cache)
    drive_random_model(spec, "fp8-block", None, dtype, cache)


def drive_quantized(dtype: torch.dtype, cache: Path) -> None:
    """rag's layer (Llama-3.2-1B's shapes) with quantized projections: W4A16 (GPTQ), online
    FP8, block FP8."""
    import dataclasses

    from kvbatch.bench.models import LLAMA_3_2_1B

    spec = dataclasses.replace(LLAMA_3_2_1B, num_hidden_layers=1, vocab_size=2048)
    for weights, quantization in (("w4a16", None), ("float", "fp8"), ("fp8-block", None)):
        drive_random_model(spec, weights, quantization, dtype, cache)


def drive_random_model(spec, weights: str, quantization, dtype, cache: Path) -> None:
    """Load the random model `spec` in `weights`' format as the engine does and run steps:
    a few prompts of uneven lengths, a long one chunked, decodes after."""
    from kvbatch.bench.models import random_model_dir
    from kvbatch.engine.model.loader import load_model

    path = random_model_dir(spec, cache_dir=cache, weights=weights)
    model = load_model(path, dtype, torch.device("cpu"), quantization=quantization).model
    for t in list(model.parameters()) + list(model.buffers()):
        # tensors read from the file keep its offsets; on a GPU every weight is a fresh,
        # aligned allocation, and the kernels are compiled for those
        t.data = t.data.clone()
    prompts = [[3 + i] * (9 + 13 * i) for i in range(5)] + [list(range(3, 203))]
    run_steps(model, dtype, prompts, [3] * len(prompts), max_num_batched_tokens=128)


def drive_gemma(dtype: torch.dtype) -> None:
    """One global and one local layer of Gemma 3 1B's shapes (head dim 256, one KV head,
    GELU(tanh) MLP, (1 + w) norms, a 512-token window) on Gemma's layers' Triton kernels."""
    from transformers import Gemma3TextConfig

    from kvbatch.engine.layers.linear import merge_projections
    from kvbatch.engine.models.gemma import GemmaForCausalLM
    from kvbatch.engine.models.llama import ModelConfig

    hf = Gemma3TextConfig(
        vocab_size=2048,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    )
    cfg = ModelConfig.from_hf(hf)
    with torch.device("meta"):
        model = GemmaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.rebuild_rotary(torch.device("cpu"))
    merge_projections(model)
    prompts = [[3 + i] * (9 + 13 * i) for i in range(5)] + [list(range(3, 703))]
    run_steps(model, dtype, prompts, [3] * len(prompts), max_num_batched_tokens=256)


def drive_gpt_oss(dtype: torch.dtype, cache: Path) -> None:
    """A sliding and a full layer of gpt-oss-20b's shapes (64 query and 8 KV heads of 64, hidden
    2,880) with 8 of its 32 experts in MXFP4: the sink attention kernels (decode, prefill,
    cascade) and the MXFP4 grouped GEMM."""
    import dataclasses

    from kvbatch.bench.models import GPT_OSS_20B_4_LAYERS

    spec = dataclasses.replace(
        GPT_OSS_20B_4_LAYERS, num_hidden_layers=2, num_experts=8, vocab_size=2048
    )
    drive_random_model(spec, "mxfp4", None, dtype, cache)


DRIVERS = {
    "llama": lambda dtype, cache: drive_engine(dtype),
    "moe": drive_moe,
    "gemma": lambda dtype, cache: drive_gemma(dtype),
    "quantized": drive_quantized,
    "gpt-oss": drive_gpt_oss,
}


def run_steps(model, dtype, prompts, max_tokens, max_num_batched_tokens):
    """Greedy requests through a scheduler and the model runner with the triton backend, to
    the end; returns the runner."""
    from kvbatch.engine.attention.triton_backend import TritonAttentionBackend
    from kvbatch.engine.core.config import SchedulerConfig
    from kvbatch.engine.core.sampling_params import SamplingParams
    from kvbatch.engine.core.sequence import Sequence
    from kvbatch.engine.exec.runner import ModelRunner
    from kvbatch.engine.kv.kv_cache import KVCacheManager
    from kvbatch.engine.sched.scheduler import Scheduler

    block_size, num_blocks = 16, 512
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens)
    scheduler = Scheduler(config, kv)
    runner = ModelRunner(
        model,
        kv,
        num_blocks,
        block_size,
        torch.device("cpu"),
        dtype,
        TritonAttentionBackend(),  # the model's layers take its kernels too
    )
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        scheduler.add(Sequence(str(i), p, params))
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        result = runner.execute(out)
        scheduler.advance(out)
        done = []
        for seq, tokens in zip(result.seqs, result.token_ids):
            seq.token_ids.extend(tokens)
            if seq.num_output_tokens >= seq.params.max_tokens:
                done.append(seq)
        scheduler.finish(done)
    return runner


def specialisations(launches: list[tuple[str, object, object]]) -> list[dict]:
    """Per kernel: how many variants were compiled, how many sets of constexpr values and
    argument types (the graph buffers' int32 tables against a step's int64 ones) they had,
    and the arguments that differed between variants beyond those (Triton's specialisations:
    an int of 1 made a constant, divisibility by 16, pointer alignment)."""
    by_kernel: dict[str, tuple[object, dict]] = {}
    for name, fn, kernel in launches:
        if kernel is not None:
            by_kernel.setdefault(name, (fn, {}))[1][kernel.hash] = kernel
    rows = []
    for name, (fn, variants) in sorted(by_kernel.items()):
        constexpr = {(i,) for i, p in enumerate(fn.params) if p.is_constexpr}
        others = {(i,) for i in range(len(fn.params))} - constexpr
        sets = set()
        seen: dict[tuple, set[str]] = {}  # argument -> its specialisations among the variants
        for kernel in variants.values():
            attrs, consts = kernel.src.attrs, kernel.src.constants
            values = sorted((key, str(v)) for key, v in consts.items() if key in constexpr)
            sig = kernel.src.signature.items()
            pointers = sorted((n, t) for n, t in sig if str(t)[:1] == "*")
            sets.add((tuple(pointers), tuple(values)))
            for key in others:
                seen.setdefault(key, set()).add(f"{attrs.get(key)} {consts.get(key)}")
        varying = {fn.arg_names[key[0]] for key, specs in seen.items() if len(specs) > 1}
        rows.append(
            {
                "kernel": name,
                "variants": len(variants),
                "constexpr_sets": len(sets),
                "varying": sorted(varying),
            }
        )
    return rows


def ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill bytes) that ptxas reports for the kernel."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [ptxas, "-v", f"--gpu-name={name}", str(src), "-o", str(Path(tmp) / "k.cubin")]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return (int(regs.group(1)) if regs else None, max(spills) if spills else None)


def check(arch: int, dtypes: list[str], models: list[str] = ("llama",)) -> dict:
    compiled = record_compiles(arch)
    rows, errors, specs = [], [], []
    cache = Path(tempfile.mkdtemp(prefix="compile-check-models-"))  # random weights, if any
    for name in dtypes:
        start = len(compiled)
        for kind in models:
            try:
                DRIVERS[kind](getattr(torch, name), cache)
            except Exception as e:  # a kernel that does not compile: the finding itself
                errors.append(f"{name} {kind}: {type(e).__name__}: {e}")
        for spec in specialisations(compiled[start:]):
            specs.append(spec | {"dtype": name})
            if spec["variants"] > spec["constexpr_sets"]:
                errors.append(
                    f"{name}: {spec['kernel']} compiled {spec['variants']} variants for "
                    f"{spec['constexpr_sets']} sets of constexprs and pointer types; arguments "
                    f"that varied: "
                    f"{', '.join(spec['varying'])} (kernels/specialize.py step_varying)"
                )
        seen = set()
        for kernel_name, _, kernel in compiled[start:]:
            if kernel is None or kernel.hash in seen:
                continue
            seen.add(kernel.hash)
            regs, spills = ptxas_usage(kernel.asm["ptx"], arch)
            shared = int(kernel.metadata.shared)
            rows.append(
                {
                    "kernel": kernel_name,
                    "dtype": name,
                    "num_warps": kernel.metadata.num_warps,
                    "num_stages": kernel.metadata.num_stages,
                    "shared_bytes": shared,
                    "registers": regs,
                    "spill_bytes": spills,
                    "fits": shared <= SM90_MAX_SHARED,
                }
            )
    ok = not errors and all(r["fits"] for r in rows)
    return {
        "arch": arch,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "ok": ok,
        "errors": errors,
        "kernels": rows,
        "specialisations": specs,
    }


def format_report(report: dict) -> str:
    lines = [
        f"Triton {report['triton']} compile check for sm_{report['arch']}: "
        f"{'OK' if report['ok'] else 'FAILED'} ({len(report['kernels'])} specialisations)",
        "",
        "| kernel | dtype | warps | stages | shared KiB | registers | spill bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["kernels"]:
        flag = "" if r["fits"] else " (over 227 KiB)"
        lines.append(
            f"| {r['kernel']} | {r['dtype']} | {r['num_warps']} | {r['num_stages']} | "
            f"{r['shared_bytes'] / 1024:.1f}{flag} | {r['registers']} | {r['spill_bytes']} |"
        )
    lines += [
        "",
        "variants compiled per kernel (sets of constexprs and pointer types): "
        + ", ".join(
            f"{r['kernel']} {r['variants']} ({r['constexpr_sets']})"
            for r in report["specialisations"]
        ),
    ]
    lines += [f"error: {e}" for e in report["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="model dtypes to drive")
    ap.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    ap.add_argument(
        "--models",
        default="llama",
        help=f"comma-separated GPU paths to drive: {', '.join(DRIVERS)} (default: llama)",
    )
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in DRIVERS]
    if unknown:
        ap.error(f"unknown --models {', '.join(unknown)}; choose from {', '.join(DRIVERS)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    report = check(args.arch, dtypes, models)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""`kvbatch bench WORKLOAD --peers hf-static [--json PATH] ...` (also `python -m kvbatch.bench.cli`).

Runs kvbatch and each peer on the workload's prompts in this one process, prints a table of
seconds, output tokens/s, latency (TTFT/TPOT p50/p99), ratios to kvbatch and the fraction of
the hardware floor, and optionally writes the same as JSON. `--tiny` runs a GPU workload's
tiny variant (same structure, tiny model, CPU); `--sweep` runs kvbatch alone over a grid of
max_num_seqs x max_num_batched_tokens x kv_cache_memory_fraction (kvbatch.bench.sweep).
`kvbatch bench WORKLOAD --help` describes that workload; a benchmark with its own options and
table (`TOOLS`, e.g. spec-copy) takes the rest of the command line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvbatch.bench import embed_bench, embed_gpu, spec_copy
from kvbatch.bench.embed_workload import EMBED_WORKLOADS, TINY_EMBED_WORKLOADS
from kvbatch.bench.harness import (
    BenchConfig,
    BenchError,
    engine_order,
    resolve_model,
    run_benchmark,
)
from kvbatch.bench.peers import PEERS, EngineOptions
from kvbatch.bench.sweep import (
    DEFAULT_BATCHED_TOKENS,
    DEFAULT_KV_FRACTIONS,
    DEFAULT_MAX_NUM_SEQS,
    SweepGrid,
    parse_list,
    run_sweep,
)
from kvbatch.bench.workloads import (
    TINY_WORKLOADS,
    WEIGHT_FORMATS,
    WORKLOADS,
    Workload,
    get_workload,
)
from kvbatch.engine_args import QUANTIZATION_CHOICES, add_gpu_tuning_args


def _lazy_main(module: str, argv: list[str] | None) -> int:
    """kvbatch.bench.MODULE's main, imported when asked for: the indexing benchmarks need
    lancedb and sentence-transformers, which a GPU image running the other workloads lacks."""
    return importlib.import_module(f"kvbatch.bench.{module}").main(argv)


TOOLS: dict[str, Callable[[list[str] | None], int]] = {
    "spec-copy": spec_copy.main,  # speculative decoding on and off, its own table
    # embeddings (texts in, vectors out): kvbatch beside sentence-transformers, its own table
    **{name: partial(embed_bench.main, name=name) for name in EMBED_WORKLOADS},
    # prefill-only throughput on embedding models' shapes (token ids in), against the floor
    "embed-gpu": embed_gpu.main,
    # the indexing job (kvbatch index) beside transformers + sentence-transformers + LanceDB
    "index-cpu": partial(_lazy_main, "index_bench"),
    # recall@5 and MRR of plain and contextual chunks on the stdlib's pydoc pages
    "index-retrieval": partial(_lazy_main, "retrieval_bench"),
    # a Gemma 3 shape with window KV on and off: sequences at once, throughput, same tokens
    "gemma-window": partial(_lazy_main, "gemma_window"),
    # a Qwen3.5 shape (linear + full attention) beside transformers, and sequences per GiB
    "hybrid-linear": partial(_lazy_main, "hybrid_linear"),
    # a DeepSeek-V3 shape (MLA + grouped experts) beside transformers, and KV bytes per token
    "mla": partial(_lazy_main, "mla"),
    # `kvbatch submit` of 10k, 100k, 1M generated chat lines: time a line and peak memory
    "submit-lines": partial(_lazy_main, "submit_bench"),
    # decode ms per step: one document's rows, a mixed batch, several documents (index shape)
    "mixed-decode": partial(_lazy_main, "mixed_decode"),
}
"""Benchmarks with their own options: `kvbatch bench NAME ...` hands them the rest of argv."""

DESCRIPTION = "Benchmark kvbatch against its peers on a named workload, side by side."


def describe_workload(name: str) -> str:
    """What `kvbatch bench NAME --help` says of the workload before the options: its shape,
    its defaults (which --model/--device/--dtype/--seed override) and its tiny variant."""
    workload = WORKLOADS[name]
    lines = [f"{name}: {workload.description}" if workload.description else name, ""]
    lines.append(workload.summary())
    lines.append(
        f"defaults: device {workload.device}, dtype {workload.dtype}, seed {workload.seed}, "
        f"model {workload.model}"
    )
    if workload.has_long_prompt:
        lines.append("kvbatch only: a prompt arrives mid-run, which the peers cannot take")
    tiny: Workload | None = TINY_WORKLOADS.get(name)
    if tiny is not None:
        lines.append(f"--tiny: {tiny.summary()}")
    return "\n".join(lines)


def build_parser(workload: str | None = None) -> argparse.ArgumentParser:
    """The options of `kvbatch bench`; with a known `workload`, its help describes it."""
    p = argparse.ArgumentParser(
        prog="kvbatch bench",
        description=DESCRIPTION if workload not in WORKLOADS else describe_workload(workload),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "workload",
        nargs="?",
        help=f"one of: {', '.join(WORKLOADS)} (`kvbatch bench WORKLOAD -h` describes one), "
        f"or {' / '.join(TOOLS)} (each has its own -h)",
    )
    p.add_argument("--list", action="store_true", help="list the workloads and engines, then exit")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="the workload's tiny variant: same structure, tiny random model, float32 on the CPU "
        f"({', '.join(TINY_WORKLOADS)})",
    )
    p.add_argument(
        "--peers",
        action="append",
        default=[],
        metavar="NAME[,NAME]",
        help="engines to compare with kvbatch, comma-separated or repeated "
        f"({', '.join(n for n in PEERS if n != 'kvbatch')})",
    )
    p.add_argument("--skip-kvbatch", action="store_true", help="run the peers only")
    p.add_argument(
        "--full-warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="before the timed runs, run kvbatch once untimed on the whole workload (another "
        "draw), so no Triton kernel is compiled inside a timed run (default: on CUDA only)",
    )
    p.add_argument(
        "--kernel-profile",
        action="store_true",
        help="after the timed runs, run kvbatch once more under torch.profiler and report "
        "where its device time went (kernels by kind, steps, the GPU's busy share)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--model", metavar="PATH", help="model folder or GGUF (default: the workload's)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine (median; 1)")
    p.add_argument("--threads", type=int, help="torch threads for every engine (torch's default)")
    p.add_argument("--device", help="override the workload's device (cpu, cuda, cuda:1)")
    p.add_argument("--dtype", help="override the workload's dtype (float32, bfloat16, float16)")
    p.add_argument("--seed", type=int, help="override the workload's seed")
    p.add_argument(
        "--compare",
        type=int,
        default=4,
        metavar="N",
        help="compare greedy tokens on the first N requests (4)",
    )

    e = p.add_argument_group("kvbatch engine")
    defaults = EngineOptions()
    e.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    e.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    e.add_argument("--block-size", type=int, default=defaults.block_size)
    e.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    e.add_argument(
        "--attention-backend",
        default=defaults.attention_backend,
        help="auto (triton on CUDA, torch on the CPU), torch or triton",
    )
    add_gpu_tuning_args(e)
    e.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        help="quantize the float weights at load (kvbatch only): fp8 = FP8 W8A8, per-channel "
        "weight scales, per-token activation scales",
    )
    e.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default="float",
        help="the random model's weights: float, w4a16 (rounded to 4 bits in groups of "
        "128 and written as a GPTQ checkpoint) or fp8-block (FP8 with a scale per 128 x 128 "
        "tile, as Qwen3-*-FP8 checkpoints; kvbatch only for both)",
    )
    e.add_argument(
        "--freeze-gc",
        action=argparse.BooleanOptionalAction,
        help="freeze the heap the engine starts with, out of the cycle collector's full "
        "passes (default: on CUDA)",
    )

    s = p.add_argument_group("sweep (kvbatch alone, one engine per cell)")
    s.add_argument(
        "--sweep",
        action="store_true",
        help="run a grid of max_num_seqs x max_num_batched_tokens x kv_cache_memory_fraction",
    )
    s.add_argument(
        "--sweep-max-num-seqs",
        default=",".join(map(str, DEFAULT_MAX_NUM_SEQS)),
        metavar="N,N",
    )
    s.add_argument(
        "--sweep-max-num-batched-tokens",
        default=",".join(map(str, DEFAULT_BATCHED_TOKENS)),
        metavar="N,N",
    )
    s.add_argument(
        "--sweep-kv-cache-memory-fraction",
        default=",".join(f"{f:g}" for f in DEFAULT_KV_FRACTIONS),
        metavar="F,F",
        help="(CUDA only: the CPU pool has a fixed size)",
    )

    h = p.add_argument_group("hf-static")
    h.add_argument(
        "--hf-batch-size",
        type=int,
        metavar="N",
        help="requests per static batch (default: the whole workload in one batch)",
    )
    return p


def config_from_args(args: argparse.Namespace, command: str) -> BenchConfig:
    """Turn parsed arguments into a BenchConfig (resolving, and if need be fetching, the model)."""
    workload = get_workload(args.workload, tiny=args.tiny)
    if args.seed is not None:
        workload = workload.with_seed(args.seed)
    peers = [n.strip() for arg in args.peers for n in arg.split(",") if n.strip()]
    unknown = [n for n in peers if n not in PEERS]
    if unknown:
        raise BenchError(f"unknown peer {', '.join(unknown)}; known: {', '.join(PEERS)}")
    if args.weights != "float" and args.quantization is not None:
        raise BenchError(
            f"--weights {args.weights} is already quantized: drop --quantization "
            f"{args.quantization} (or use --weights float)"
        )
    others = [n for n in peers if not n.startswith("kvbatch")]
    if args.weights != "float" and others:
        raise BenchError(
            f"--weights {args.weights} is a quantized checkpoint that only kvbatch runs here: drop "
            f"--peers {','.join(others)} (compare with a float run of kvbatch instead)"
        )
    options = EngineOptions(
        device=args.device or workload.device,
        dtype=args.dtype or workload.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        attention_backend=args.attention_backend,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_step_ratio=args.long_prefill_step_ratio,
        cuda_graph_max_chunk=args.cuda_graph_max_chunk,
        cuda_graphs=args.cuda_graphs,
        freeze_gc=args.freeze_gc,
        hf_batch_size=args.hf_batch_size or workload.hf_batch_size,
    )
    return BenchConfig(
        workload=workload,
        model_path=resolve_model(workload, args.model, weights=args.weights),
        engines=engine_order(peers, include_kvbatch=not args.skip_kvbatch),
        options=options,
        repeat=args.repeat,
        threads=args.threads,
        compare_requests=args.compare,
        kernel_profile=args.kernel_profile,
        full_warmup=args.full_warmup,
        command=command,
    )


def sweep_grid_from_args(args: argparse.Namespace) -> SweepGrid:
    """The --sweep grid; the sweep runs kvbatch alone, so peers are refused."""
    if args.peers or args.skip_kvbatch:
        raise BenchError("--sweep runs kvbatch alone: drop --peers and --skip-kvbatch")
    return SweepGrid(
        max_num_seqs=parse_list(args.sweep_max_num_seqs, int, "--sweep-max-num-seqs"),
        max_num_batched_tokens=parse_list(
            args.sweep_max_num_batched_tokens, int, "--sweep-max-num-batched-tokens"
        ),
        kv_cache_memory_fraction=parse_list(
            args.sweep_kv_cache_memory_fraction, float, "--sweep-kv-cache-memory-fraction"
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: `argv` is what follows `kvbatch bench`. Returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in TOOLS:
        return TOOLS[argv[0]](argv[1:])
    named = next((a for a in argv if not a.startswith("-")), None)  # for --help's description
    parser = build_parser(named)
    args = parser.parse_args(argv)
    if args.list:
        for w in WORKLOADS.values():
            print(w.summary())
        for name, w in TINY_WORKLOADS.items():
            print(f"--tiny {name}: {w.summary()}")
        for w in EMBED_WORKLOADS.values():
            print(w.summary())
        for name, w in TINY_EMBED_WORKLOADS.items():
            print(f"--tiny {name}: {w.summary()}")
        print("engines: " + ", ".join(PEERS))
        return 0
    if args.workload is None:
        parser.error("a workload is required (see --list)")
    command = shlex.join(["kvbatch", "bench", *argv])
    try:
        config = config_from_args(args, command)
        grid = sweep_grid_from_args(args) if args.sweep else None
    except (BenchError, ValueError) as e:  # bad arguments
        print(f"kvbatch bench: error: {e}", file=sys.stderr)
        return 2
    progress = lambda m: print(m, file=sys.stderr, flush=True)

    def write_json(report) -> None:
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")

    try:  # a ValueError from inside an engine is a bug: let its traceback through
        if grid is not None:
            report = run_sweep(config, grid, progress=progress)
        else:  # with --kernel-profile the timed runs' JSON is written before the profiled run
            report = run_benchmark(config, progress=progress, checkpoint=write_json)
    except BenchError as e:
        print(f"kvbatch bench: error: {e}", file=sys.stderr)
        return 2
    print(report.format_table())
    if args.json is not None:
        write_json(report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The run both architecture benches share (`kvbatch bench hybrid-linear`, `kvbatch bench
mla`): one seeded job of prompts sharing a system prompt, greedy, through kvbatch (continuous
batching, prefix caching) and through transformers' generate one prompt at a time, the
tokens compared, and the side-by-side table and JSON fields every such row has.

Each bench adds what is its own (the model it builds, its memory figure) around these.
"""

from __future__ import annotations

import argparse
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvbatch.bench.machine import machine_info
from kvbatch.bench.text_table import format_rows
from kvbatch.engine import LLM, SamplingParams


@dataclass(frozen=True)
class SideBySide:
    """Both runs of the job: seconds, greedy tokens, and kvbatch's prefix hits and KV bytes a
    token (its startup figure)."""

    kvbatch_seconds: float
    transformers_seconds: float
    same_tokens: bool
    prefix_hits: int
    kv_bytes_per_token: int


def add_job_arguments(p: argparse.ArgumentParser, sizes: list[str]) -> None:
    """The job's, the machine's and the output's flags."""
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=192)
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/kvbatch/bench")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--size", choices=sorted(sizes), default="tiny", help="tiny (CPU) or gpu")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="default float32 on the CPU, bfloat16 on cuda")


def check_job_arguments(args: argparse.Namespace) -> None:
    """Refuses a job without a shared prefix and a tail; sets the threads and the dtype."""
    if not 0 < args.system_tokens < args.prompt_tokens:
        raise SystemExit("--system-tokens must be between 0 and --prompt-tokens")
    torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")


def shared_prefix_job(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """--num-prompts prompts: one system prompt, then a unique tail each (seeded)."""
    rng = random.Random(args.seed)
    vocab = range(3, vocab_size)
    system = rng.choices(vocab, k=args.system_tokens)
    tail = args.prompt_tokens - args.system_tokens
    return [system + rng.choices(vocab, k=tail) for _ in range(args.num_prompts)]


def run_side_by_side(path: Path, prompts: list[list[int]], args) -> SideBySide:
    kv_s, kv_tokens, hits, kv_bytes = _run_kvbatch(path, prompts, args)
    hf_s, hf_tokens = _run_transformers(path, prompts, args)
    return SideBySide(kv_s, hf_s, kv_tokens == hf_tokens, hits, kv_bytes)


def _run_kvbatch(path: Path, prompts, args) -> tuple[float, list[list[int]], int, int]:
    llm = LLM(str(path), device=args.device, dtype=args.dtype, max_num_seqs=args.num_prompts)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return seconds, tokens, llm.stats().prefix_hits, llm.engine.kv_bytes_per_token


def _run_transformers(path: Path, prompts, args) -> tuple[float, list[list[int]]]:
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    start, out = time.perf_counter(), []
    for ids in prompts:
        with torch.inference_mode():
            gen = model.generate(
                torch.tensor([ids], device=args.device),
                max_new_tokens=args.output_tokens,
                do_sample=False,
                eos_token_id=None,
            )
        out.append(gen[0, len(ids) :].tolist())
    return time.perf_counter() - start, out


def print_side_by_side(run: SideBySide, args) -> None:
    out_tokens = args.num_prompts * args.output_tokens
    kv_s, hf_s = run.kvbatch_seconds, run.transformers_seconds
    rows = [
        ["engine", "seconds", "output tok/s", "prefix hits"],
        ["kvbatch", f"{kv_s:.2f}", f"{out_tokens / kv_s:.1f}", str(run.prefix_hits)],
        ["transformers", f"{hf_s:.2f}", f"{out_tokens / hf_s:.1f}", "-"],
    ]
    print("\n".join(format_rows(rows)))
    print(
        f"kvbatch / transformers: {hf_s / kv_s:.2f}x; greedy tokens "
        f"{'identical' if run.same_tokens else 'DIFFER'}"
    )


def result_fields(bench: str, argv: list[str], args, run: SideBySide) -> dict:
    """The JSON fields every such row has; the bench adds its own."""
    return {
        "bench": bench,
        "command": shlex.join(["kvbatch", "bench", bench, *argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(args.device),
        "size": args.size,
        "dtype": args.dtype,
        "kvbatch_seconds": run.kvbatch_seconds,
        "transformers_seconds": run.transformers_seconds,
        "prefix_hits": run.prefix_hits,
        "same_tokens": run.same_tokens,
    }

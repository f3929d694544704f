"""`kvbatch bench gemma-window`: the same job on a Gemma 3 shape with window KV on and off.

Gemma 3 attends within a sliding window in five of every six layers. With `sliding_window_kv`
on, those layers keep their own block tables and free the blocks that have left the window, so
a fixed KV budget holds more sequences at once, and a memory-bound batch job runs with a larger
decode batch. This bench runs one seeded job twice in one process, each time on a fresh engine
with the same `kv_cache_bytes`, and reports per mode the sequences held at once (the scheduler's
running list, sampled after every step), the pool's blocks, preemptions, wall time and output
tokens/s, then the on/off ratios. Greedy tokens must be identical between the modes: the window
changes where KV lives, never what attention reads.

    kvbatch bench gemma-window [--size tiny|cpu|gpu] [--prompt-tokens N] [--window N] ...

The model is random (no download): a Gemma3TextConfig of the size's shape, weights drawn from a
seeded generator, written once into a folder under `--cache-dir`. The KV budget, unless given,
holds `--budget-seqs` whole sequences (prompt + output) with every layer keeping every block.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from kvbatch.bench.machine import machine_info
from kvbatch.bench.models import build_once
from kvbatch.bench.text_table import format_rows
from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.core.arg_values import byte_size, positive_int

FIRST_TOKEN_ID = 3  # prompts avoid pad (0), BOS (1) and EOS (2)
WEIGHT_STD = 0.1  # larger than transformers' 0.02: decisive greedy tokens on random weights


@dataclass(frozen=True)
class GemmaShape:
    """The fields of a Gemma3TextConfig that size the model and its KV."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    dtype: str  # of the weights and the KV cache

    def config(self, window: int, max_len: int) -> Gemma3TextConfig:
        """transformers fills layer_types: five sliding-window layers to one global."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("name", "dtype")}
        config = Gemma3TextConfig(
            **fields,
            sliding_window=window,
            max_position_embeddings=max_len,
            query_pre_attn_scalar=self.head_dim,
            initializer_range=WEIGHT_STD,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        config.architectures = ["Gemma3ForCausalLM"]
        config.dtype = self.dtype
        return config


@dataclass(frozen=True)
class Size:
    """A preset: the model's shape and the job's defaults (each flag overrides its own)."""

    shape: GemmaShape
    device: str
    window: int
    prompt_tokens: int
    output_tokens: int
    num_prompts: int
    budget_seqs: int  # whole sequences the default KV budget holds without window KV


SIZES = {
    # seconds on one CPU thread: the tests' and gpu-check --cpu's size
    "tiny": Size(
        GemmaShape("gemma3-tiny", 64, 128, 6, 2, 1, 32, 512, "float32"),
        "cpu", window=32, prompt_tokens=256, output_tokens=8, num_prompts=6, budget_seqs=2,
    ),
    # one to three minutes on one CPU thread
    "cpu": Size(
        GemmaShape("gemma3-6-layers", 256, 1024, 6, 4, 1, 64, 4096, "float32"),
        "cpu", window=128, prompt_tokens=2048, output_tokens=64, num_prompts=24, budget_seqs=4,
    ),
    # Gemma 3 1B's shape (26 layers, 22 of them windowed), bfloat16 on one GPU
    "gpu": Size(
        GemmaShape("gemma-3-1b", 1152, 6912, 26, 4, 1, 256, 262144, "bfloat16"),
        "cuda", window=512, prompt_tokens=8192, output_tokens=256, num_prompts=64, budget_seqs=8,
    ),
}  # fmt: skip


@dataclass
class ModeRun:
    """One mode's run of the job."""

    mode: str  # "on" or "off": sliding_window_kv
    seconds: float
    output_tokens: int
    steps: int
    max_running: int  # most sequences in the scheduler's running list after a step
    mean_running: float  # over the steps
    num_kv_blocks: int
    num_preemptions: int  # in the timed run
    token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def row(self) -> dict[str, Any]:
        """The JSON row (tokens left out)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != "token_ids"}
        return fields | {"tokens_per_s": self.tokens_per_s}


def checkpoint_dir(shape: GemmaShape, window: int, max_len: int, cache_dir: Path) -> Path:
    """The random checkpoint's folder, built on first use: a Hugging Face folder
    (config.json, model.safetensors) named by a digest of what it holds, written to a
    temporary folder and renamed, so an interrupted build is never taken for a finished one."""
    spec = dataclasses.asdict(shape) | {"window": window, "max_len": max_len, "std": WEIGHT_STD}
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    dest = cache_dir / f"{shape.name}-{digest}"

    def write(folder: Path) -> None:
        config = shape.config(window, max_len)
        config.save_pretrained(str(folder))
        weights = random_weights(config, getattr(torch, shape.dtype))
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})

    return build_once(dest, lambda d: (d / "model.safetensors").is_file(), write)


def random_weights(
    config: Gemma3TextConfig, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Seeded normal weights of std WEIGHT_STD in `dtype`; norm weights 0 (Gemma's
    RMSNorm scales by 1 + weight). Names and shapes come from transformers' module tree on the
    meta device; the draw runs on the GPU when there is one (a 1B model in seconds)."""
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, meta in shell.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        t = torch.zeros(meta.shape, dtype=torch.float32, device=device)
        if not name.endswith("norm.weight"):
            t.normal_(0.0, WEIGHT_STD, generator=gen)
        weights[name] = t.to(dtype).cpu().contiguous()
    return weights


def kv_bytes_per_token(shape: GemmaShape) -> int:
    """K and V of every layer, each layer keeping every token (window KV off)."""
    elem = torch.finfo(getattr(torch, shape.dtype)).bits // 8
    return shape.num_hidden_layers * 2 * shape.num_key_value_heads * shape.head_dim * elem


def default_kv_bytes(shape: GemmaShape, seq_tokens: int, block_size: int, seqs: int) -> int:
    """A budget of `seqs` whole sequences in whole blocks, window KV off."""
    blocks = -(-seq_tokens // block_size)
    return seqs * blocks * block_size * kv_bytes_per_token(shape)


def seeded_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n distinct random prompts: no prefix is shared, so prefix caching plays no part."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN_ID, vocab, (n, length), generator=g).tolist()


def run_mode(
    model_dir: Path, on: bool, prompts: list[list[int]], args: argparse.Namespace
) -> ModeRun:
    """A fresh engine with window KV `on` or off runs the job, stepped by hand so that the
    running list can be read after every step; a short warm-up (other prompts) goes first."""
    llm = LLM(
        model=str(model_dir),
        device=args.device,
        dtype=args.shape.dtype,
        kv_cache_bytes=args.kv_cache_bytes,
        sliding_window_kv=on,
        block_size=args.block_size,
        max_model_len=args.prompt_tokens + args.output_tokens,
    )
    engine = llm.engine
    warm = seeded_prompts(2, args.prompt_tokens, args.shape.vocab_size, args.seed + 1)
    llm.generate(warm, _params(4), use_tqdm=False)
    preempted = llm.stats().num_preemptions
    params = _params(args.output_tokens)
    mode = "on" if on else "off"
    _synchronize(args.device)
    start = time.perf_counter()
    ids = [engine.add_request(p, params, request_id=f"{mode}-{i}") for i, p in enumerate(prompts)]
    finished: dict[str, Any] = {}
    running: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            finished[out.request_id] = out
        running.append(len(engine.scheduler.running))
    _synchronize(args.device)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    tokens = [list(finished[rid].outputs[0].token_ids) for rid in ids]
    run = ModeRun(
        mode=mode,
        seconds=seconds,
        output_tokens=sum(len(t) for t in tokens),
        steps=len(running),
        max_running=max(running, default=0),
        mean_running=statistics.fmean(running) if running else 0.0,
        num_kv_blocks=stats.num_kv_blocks,
        num_preemptions=stats.num_preemptions - preempted,
        token_ids=tokens,
    )
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next engine sizes its pool from the same memory
    return run


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(request, position) of the first token that differs, or None when all are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            pos = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return i, pos
    return None


def ratios(on: ModeRun, off: ModeRun) -> dict[str, float | None]:
    """on / off for sequences at once (most and mean) and output tokens/s."""

    def r(a: float, b: float) -> float | None:
        return a / b if b else None

    return {
        "max_running": r(on.max_running, off.max_running),
        "mean_running": r(on.mean_running, off.mean_running),
        "tokens_per_s": r(on.tokens_per_s, off.tokens_per_s),
    }


def report_text(runs: dict[str, ModeRun], args: argparse.Namespace) -> str:
    """The job in one line, then a row per mode."""
    shape = args.shape
    windowed = sum(t == "sliding_attention" for t in shape.config(1, 1).layer_types)
    head = (
        f"gemma-window: {shape.name} ({shape.num_hidden_layers} layers, {windowed} windowed, "
        f"window {args.window}), {args.num_prompts} prompts of {args.prompt_tokens} tokens, "
        f"{args.output_tokens} out, KV budget {args.kv_cache_bytes / 2**20:.1f} MiB, "
        f"{args.device}, {torch.get_num_threads()} threads"
    )
    table = [
        ["window KV", "KV blocks", "most seqs", "mean seqs", "preempted", "steps", "s", "tok/s"]
    ]
    for run in (runs["off"], runs["on"]):
        table.append(
            [
                run.mode,
                str(run.num_kv_blocks),
                str(run.max_running),
                f"{run.mean_running:.1f}",
                str(run.num_preemptions),
                str(run.steps),
                f"{run.seconds:.2f}",
                f"{run.tokens_per_s:.1f}",
            ]
        )
    return "\n".join([head, "", *format_rows(table)])


def verdict_line(runs: dict[str, ModeRun], diff: tuple[int, int] | None) -> str:
    """The last line printed (the GPU check's steps table shows it): ratios and tokens."""
    r = ratios(runs["on"], runs["off"])
    ratio_text = (
        f"sequences at once {_x(r['max_running'])} (most), {_x(r['mean_running'])} (mean); "
        f"throughput {_x(r['tokens_per_s'])}"
    )
    if diff is None:
        return f"gemma-window on/off: {ratio_text}; greedy tokens identical"
    return (
        f"gemma-window FAIL: greedy tokens differ between window KV on and off (request "
        f"{diff[0]}, token {diff[1]}); on/off: {ratio_text}"
    )


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbatch bench gemma-window",
        description="A Gemma 3 shape (random weights) with window KV on and off, same KV "
        "budget: sequences at once, throughput, greedy tokens compared.",
    )
    p.add_argument("--size", choices=SIZES, default="cpu", help="model and job preset (cpu)")
    p.add_argument("--prompt-tokens", type=positive_int, metavar="N", help="tokens per prompt")
    p.add_argument(
        "--output-tokens", type=positive_int, metavar="N", help="tokens generated per prompt"
    )
    p.add_argument("--num-prompts", type=positive_int, metavar="N", help="prompts in the job")
    p.add_argument(
        "--window", type=positive_int, metavar="N", help="the local layers' sliding window"
    )
    p.add_argument("--kv-cache-bytes", type=byte_size, metavar="SIZE", help="KV budget, e.g. 2GiB")
    p.add_argument(
        "--budget-seqs",
        type=positive_int,
        metavar="N",
        help="without --kv-cache-bytes: a budget of N whole sequences, window KV off",
    )
    p.add_argument("--block-size", type=positive_int, default=16, metavar="N")
    p.add_argument("--device", help="cpu or cuda (default: the size's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (1)")
    p.add_argument("--cache-dir", type=Path, help="random checkpoints' folder (in the temp dir)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    return p


def resolve_args(argv: list[str] | None) -> argparse.Namespace:
    """Parsed flags with the size's defaults filled in and the KV budget computed."""
    args = build_parser().parse_args(argv)
    size = SIZES[args.size]
    args.shape = size.shape
    for name in ("device", "window", "prompt_tokens", "output_tokens", "num_prompts"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(size, name))
    args.budget_seqs = args.budget_seqs or size.budget_seqs
    if args.kv_cache_bytes is None:
        seq = args.prompt_tokens + args.output_tokens
        args.kv_cache_bytes = default_kv_bytes(args.shape, seq, args.block_size, args.budget_seqs)
    if args.cache_dir is None:
        args.cache_dir = Path(tempfile.gettempdir()) / "kvbatch-gemma-window"
    return args


def main(argv: list[str] | None = None) -> int:
    """Returns 0, or 1 when the modes' greedy tokens differ."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve_args(argv)
    torch.set_num_threads(args.threads)
    max_len = args.prompt_tokens + args.output_tokens
    model_dir = checkpoint_dir(args.shape, args.window, max_len, args.cache_dir)
    prompts = seeded_prompts(args.num_prompts, args.prompt_tokens, args.shape.vocab_size, args.seed)
    runs = {}
    for on in (False, True):
        run = run_mode(model_dir, on, prompts, args)
        runs[run.mode] = run
        print(f"window KV {run.mode}: {run.seconds:.2f} s", file=sys.stderr, flush=True)
    diff = first_difference(runs["off"].token_ids, runs["on"].token_ids)
    print(report_text(runs, args))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result_json(runs, args, argv, diff), indent=2) + "\n")
        print(f"wrote {args.json}")
    print(verdict_line(runs, diff))
    return 0 if diff is None else 1


def result_json(
    runs: dict[str, ModeRun],
    args: argparse.Namespace,
    argv: list[str],
    diff: tuple[int, int] | None,
) -> dict[str, Any]:
    return {
        "bench": "gemma-window",
        "command": shlex.join(["kvbatch", "bench", "gemma-window", *argv]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(args.device),
        "model": dataclasses.asdict(args.shape) | {"window": args.window},
        "job": {
            "num_prompts": args.num_prompts,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "block_size": args.block_size,
            "kv_cache_bytes": args.kv_cache_bytes,
            "seed": args.seed,
        },
        "modes": {mode: run.row() for mode, run in runs.items()},
        "ratios": ratios(runs["on"], runs["off"]),
        "greedy_identical": diff is None,
        "first_difference": None if diff is None else list(diff),
    }


if __name__ == "__main__":
    sys.exit(main())

"""`kvbatch bench hybrid-linear`: a hybrid linear-attention model (Qwen3.5's shape: three
Gated DeltaNet layers to one gated full-attention layer) in kvbatch beside transformers, and
the sequences one GB of cache holds against a full-attention model of the same shape.

One seeded job (a shared system prompt, then a unique tail per prompt; greedy answers) runs
through kvbatch (continuous batching, the state cache, snapshots at the shared prompt's end)
and through transformers' generate one prompt at a time (its torch fallbacks of the gated
delta rule); the greedy tokens must be identical. Then, from the engine's own sizing
formulas, per sequence of `--context` tokens: the hybrid's KV (full-attention layers only)
plus one state slot, against KV in every layer.

    kvbatch bench hybrid-linear [--num-prompts N] [--prompt-tokens N] [--system-tokens N]
                                [--output-tokens N] [--context N] [--json PATH]
                                [--size tiny|gpu] [--device cpu|cuda] [--dtype D]

The model is random (no download): a Qwen3_5TextConfig written once into `--cache-dir`.
`--size tiny` (the default) is 8 small layers for the CPU; `--size gpu` is a Qwen3.5-shaped
model at about 2B parameters (24 layers, 18 DeltaNet and 6 full attention; assumed layer
sizes, not a published checkpoint's) for the GPU table, in bfloat16 on cuda.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import Qwen3_5TextConfig

from kvbatch.bench.machine import machine_info
from kvbatch.bench.models import build_once
from kvbatch.bench.text_table import format_rows
from kvbatch.engine import LLM, SamplingParams
from kvbatch.engine.kv.stateful import state_shape
from kvbatch.engine.model.linear_attention import LinearAttentionConfig

TINY_SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=4096,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
GPU_SHAPE = {
    **TINY_SHAPE,
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "max_position_embeddings": 65536,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 6,
    "initializer_range": 0.02,
}
SHAPES = {"tiny": TINY_SHAPE, "gpu": GPU_SHAPE}


def model_dir(cache_dir: Path, size: str = "tiny") -> Path:
    shape = SHAPES[size]

    def write(folder: Path) -> None:
        torch.manual_seed(0)
        dtype = torch.float32 if size == "tiny" else torch.bfloat16  # 2B at 4 GB, not 8
        model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**shape), dtype=dtype)
        model.save_pretrained(folder)

    name = "qwen3.5-shape" if size == "tiny" else f"qwen3.5-shape-{size}"
    return build_once(cache_dir / name, lambda p: (p / "config.json").exists(), write)


def job(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    vocab = range(3, SHAPES[args.size]["vocab_size"])
    system = rng.choices(vocab, k=args.system_tokens)
    tail = args.prompt_tokens - args.system_tokens
    return [system + rng.choices(vocab, k=tail) for _ in range(args.num_prompts)]


def run_kvbatch(path: Path, prompts, args) -> tuple[float, list[list[int]], int]:
    llm = LLM(str(path), device=args.device, dtype=args.dtype, max_num_seqs=args.num_prompts)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, [o.outputs[0].token_ids for o in outs], llm.stats().prefix_hits


def run_transformers(path: Path, prompts, args) -> tuple[float, list[list[int]]]:
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


def sequences_per_gb(
    context: int, dtype: torch.dtype = torch.bfloat16, shape: dict = TINY_SHAPE
) -> dict[str, float]:
    """Sequences of `context` tokens one GiB holds: the hybrid (KV in its full-attention
    layers, one state slot) and the same shape with KV in every layer."""
    config = Qwen3_5TextConfig(**shape)
    linear = LinearAttentionConfig.from_hf("Qwen3_5ForCausalLM", config)
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * shape["num_key_value_heads"] * shape["head_dim"] * elem * context
    hybrid = len(linear.full_layers) * per_layer + state_shape(linear).bytes_per_slot(dtype)
    full = shape["num_hidden_layers"] * per_layer
    return {"hybrid": 2**30 / hybrid, "full_attention": 2**30 / full}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbatch bench hybrid-linear", description=__doc__)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=192)
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--context", type=int, default=32768, help="sequence length for per-GB")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/kvbatch/bench")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--size", choices=sorted(SHAPES), default="tiny", help="tiny (CPU) or gpu")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="default float32 on the CPU, bfloat16 on cuda")
    return p


def main(argv: list[str] | None = None) -> int:
    """Returns 0, or 1 when kvbatch's greedy tokens differ from transformers'."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not 0 < args.system_tokens < args.prompt_tokens:
        raise SystemExit("--system-tokens must be between 0 and --prompt-tokens")
    torch.set_num_threads(args.threads)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    path = model_dir(args.cache_dir, args.size)
    prompts = job(args)
    kv_s, kv_tokens, hits = run_kvbatch(path, prompts, args)
    hf_s, hf_tokens = run_transformers(path, prompts, args)
    same = kv_tokens == hf_tokens
    out_tokens = args.num_prompts * args.output_tokens
    per_gb = sequences_per_gb(args.context, shape=SHAPES[args.size])
    rows = [
        ["engine", "seconds", "output tok/s", "prefix hits"],
        ["kvbatch", f"{kv_s:.2f}", f"{out_tokens / kv_s:.1f}", str(hits)],
        ["transformers", f"{hf_s:.2f}", f"{out_tokens / hf_s:.1f}", "-"],
    ]
    print("\n".join(format_rows(rows)))
    print(
        f"kvbatch / transformers: {hf_s / kv_s:.2f}x; greedy tokens "
        f"{'identical' if same else 'DIFFER'}"
    )
    print(
        f"sequences of {args.context} tokens per GiB (bfloat16): hybrid "
        f"{per_gb['hybrid']:.2f}, full attention of the same shape "
        f"{per_gb['full_attention']:.2f} ({per_gb['hybrid'] / per_gb['full_attention']:.2f}x)"
    )
    if args.json is not None:
        result = {
            "bench": "hybrid-linear",
            "command": shlex.join(["kvbatch", "bench", "hybrid-linear", *argv]),
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine_info(args.device),
            "size": args.size,
            "dtype": args.dtype,
            "kvbatch_seconds": kv_s,
            "transformers_seconds": hf_s,
            "prefix_hits": hits,
            "same_tokens": same,
            "sequences_per_gib": per_gb,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

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
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5 import Qwen3_5TextConfig

from kvbatch.bench.beside_transformers import (
    add_job_arguments,
    check_job_arguments,
    print_side_by_side,
    result_fields,
    run_side_by_side,
    shared_prefix_job,
)
from kvbatch.bench.models import build_once
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
    add_job_arguments(p, list(SHAPES))
    p.add_argument("--context", type=int, default=32768, help="sequence length for per-GB")
    return p


def main(argv: list[str] | None = None) -> int:
    """Returns 0, or 1 when kvbatch's greedy tokens differ from transformers'."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_job_arguments(args)
    path = model_dir(args.cache_dir, args.size)
    prompts = shared_prefix_job(args, SHAPES[args.size]["vocab_size"])
    run = run_side_by_side(path, prompts, args)
    per_gb = sequences_per_gb(args.context, shape=SHAPES[args.size])
    print_side_by_side(run, args)
    print(
        f"sequences of {args.context} tokens per GiB (bfloat16): hybrid "
        f"{per_gb['hybrid']:.2f}, full attention of the same shape "
        f"{per_gb['full_attention']:.2f} ({per_gb['hybrid'] / per_gb['full_attention']:.2f}x)"
    )
    if args.json is not None:
        result = result_fields("hybrid-linear", argv, args, run) | {"sequences_per_gib": per_gb}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if run.same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())

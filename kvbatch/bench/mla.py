"""`kvbatch bench mla`: a multi-head latent attention model (DeepSeek-V3's layer: MLA with
q_lora, a dense first layer, grouped routing, shared experts) in kvbatch beside transformers,
and the KV bytes per token of its latent cache against a GQA model of the same layers.

One seeded job (a shared system prompt, then a unique tail per prompt; greedy answers) runs
through kvbatch (continuous batching, prefix caching, expanded prefill, absorbed decode over
the latent cache) and through transformers' generate one prompt at a time; the greedy tokens
must be identical. Then the KV bytes per token: kvbatch's own figure (the engine's startup
line: (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes) against K and V of
`--gqa-kv-heads` heads of qk_nope + qk_rope dims in every layer, and the same two for
DeepSeek-V3's published shape (computed from its config, not run).

    kvbatch bench mla [--num-prompts N] [--prompt-tokens N] [--system-tokens N]
                      [--output-tokens N] [--gqa-kv-heads N] [--json PATH]
                      [--size tiny|gpu] [--device cpu|cuda] [--dtype D] [--threads N]

The model is random (no download): a DeepseekV3Config written once into `--cache-dir`.
`--size tiny` (the default) is 4 small layers for the CPU; `--size gpu` has DeepSeek-V3's
attention widths (128 heads, kv_lora_rank 512, rope 64, q_lora_rank 1536: the kernels' real
tiles) on a narrower residual stream and 16 experts, 4 layers, for the GPU table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from kvbatch.bench.beside_transformers import (
    add_job_arguments,
    check_job_arguments,
    print_side_by_side,
    result_fields,
    run_side_by_side,
    shared_prefix_job,
)
from kvbatch.bench.models import build_once

TINY_SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
GPU_SHAPE = dict(
    TINY_SHAPE,
    vocab_size=32768,
    hidden_size=2048,
    intermediate_size=4096,
    moe_intermediate_size=1024,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    initializer_range=0.02,
)
SHAPES = {"tiny": TINY_SHAPE, "gpu": GPU_SHAPE}


def model_dir(cache_dir: Path, size: str = "tiny") -> Path:
    def write(folder: Path) -> None:
        torch.manual_seed(0)
        config = DeepseekV3Config(**SHAPES[size])
        dtype = torch.float32 if size == "tiny" else torch.bfloat16  # 1.6 GB, not 3.2
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)

    name = "deepseek-v3-shape" if size == "tiny" else f"deepseek-v3-shape-{size}"
    return build_once(cache_dir / name, lambda p: (p / "config.json").exists(), write)


def kv_bytes_per_token(config, gqa_kv_heads: int, elem: int = 2) -> dict[str, int]:
    """Bytes one token's cache costs over all layers: the MLA latent, and K and V of
    `gqa_kv_heads` heads of qk_nope + qk_rope dims (a GQA model of the same layers)."""
    layers = config.num_hidden_layers
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * layers * elem
    head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return {"mla": latent, "gqa": 2 * gqa_kv_heads * head_dim * layers * elem}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvbatch bench mla", description=__doc__)
    add_job_arguments(p, list(SHAPES))
    p.add_argument("--gqa-kv-heads", type=int, default=8, help="KV heads of the GQA figure")
    return p


def main(argv: list[str] | None = None) -> int:
    """Returns 0, or 1 when kvbatch's greedy tokens differ from transformers'."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_job_arguments(args)
    path = model_dir(args.cache_dir, args.size)
    prompts = shared_prefix_job(args, SHAPES[args.size]["vocab_size"])
    run = run_side_by_side(path, prompts, args)
    measured = run.kv_bytes_per_token
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    ours = kv_bytes_per_token(DeepseekV3Config(**SHAPES[args.size]), args.gqa_kv_heads, elem)
    v3 = kv_bytes_per_token(DeepseekV3Config(), args.gqa_kv_heads)
    print_side_by_side(run, args)
    print(
        f"KV bytes per token ({args.dtype}): MLA {measured:,} (engine; formula {ours['mla']:,}), "
        f"GQA with {args.gqa_kv_heads} KV heads {ours['gqa']:,} ({ours['gqa'] / measured:.1f}x); "
        f"DeepSeek-V3's shape in bfloat16: MLA {v3['mla']:,}, GQA {v3['gqa']:,} "
        f"({v3['gqa'] / v3['mla']:.1f}x)"
    )
    if args.json is not None:
        result = result_fields("mla", argv, args, run) | {
            "kv_bytes_per_token": {"engine": measured, **ours},
            "deepseek_v3_kv_bytes_per_token": v3,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if run.same_tokens else 1


if __name__ == "__main__":
    sys.exit(main())

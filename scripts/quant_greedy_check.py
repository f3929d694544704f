"""Greedy tokens of kvbatch's quantized GPU path (kvbatch.kernels' GEMMs, the triton attention
backend) against its reference path (the torch backend: dequantized weights, the same
activation quantization in plain torch), on the same device, float32, random-weight Llama.

    python scripts/quant_greedy_check.py --device cuda --models tiny,rag,tiny-moe
    TRITON_INTERPRET=1 python scripts/quant_greedy_check.py --device cpu --models tiny,tiny-moe

Schemes: `fp8` is online FP8 W8A8 (quantization="fp8": per-channel weight scales, per-token
activation scales); `w4a16` is the random model rounded to 4 bits and written as a GPTQ
checkpoint (kvbatch.bench.rtn_w4a16); `fp8-block` is the random model written as a block-wise
FP8 checkpoint (a scale per 128 x 128 tile, kvbatch.bench.fp8_block; activations per token and
group of 128). `tiny-moe` (a tiny Qwen3-MoE) runs its quantized experts
in the fused MoE kernel against their torch reference. Both runs quantize alike, so they differ only in the
order of float32 sums, and an activation that lands on a rounding boundary can flip one
quantization step: a broken kernel answers garbage from the first token, a correct one agrees
for many. Each prompt must agree on its first MIN_AGREE tokens and the chosen tokens'
logprobs must stay within LOGPROB_TOL where the tokens agree. Exit status 0 when all pass.
Both engines keep their defaults otherwise: on CUDA the kernels run's decode steps replay CUDA
graphs, so the quantized GEMMs are checked inside captured graphs too.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np
import torch

from kvbatch.bench.models import (
    LLAMA_3_2_1B,
    TINY_LLAMA,
    TINY_QWEN3_MOE,
    ModelSpec,
    random_model_dir,
)

MODELS: dict[str, ModelSpec] = {"tiny": TINY_LLAMA, "rag": LLAMA_3_2_1B, "tiny-moe": TINY_QWEN3_MOE}
SCHEMES = ("fp8", "w4a16", "fp8-block")
MIN_AGREE = 4  # tokens every prompt must share before its first difference
LOGPROB_TOL = 0.05  # |logprob difference| of a chosen token where both paths agree


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Four prompts of odd lengths, one of them longer than a block and a step's budget."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in (5, 17, 40, 101)]


def run(path, quantization: str | None, backend: str, prompts, args) -> tuple[list, list]:
    """(tokens, chosen-token logprobs) per prompt, all prompts in one batch."""
    from kvbatch.engine import LLM, SamplingParams

    llm = LLM(
        model=str(path),
        device=args.device,
        dtype="float32",
        attention_backend=backend,
        quantization=quantization,
        max_num_batched_tokens=64,
        max_model_len=512,
        kv_cache_bytes=1 << 28,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0
    )
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [list(o.token_ids) for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def agreement(ref: list[int], got: list[int]) -> int:
    """Tokens equal before the first difference."""
    n = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        n += 1
    return n


def check(model: str, scheme: str, args: argparse.Namespace) -> bool:
    spec = MODELS[model]
    t0 = time.perf_counter()
    path = random_model_dir(spec, weights="float" if scheme == "fp8" else scheme)
    quantization = "fp8" if scheme == "fp8" else None
    prompts = make_prompts(spec.vocab_size, args.seed)
    ref, ref_lp = run(path, quantization, "torch", prompts, args)
    got, got_lp = run(path, quantization, "triton", prompts, args)
    agreed = [agreement(r, g) for r, g in zip(ref, got)]
    worst = max(
        (abs(a - b) for n, ra, ga in zip(agreed, ref_lp, got_lp) for a, b in zip(ra[:n], ga[:n])),
        default=0.0,
    )
    ok = min(agreed) >= min(MIN_AGREE, args.max_tokens) and worst <= LOGPROB_TOL
    print(
        f"[{model} {scheme}] {'ok' if ok else 'FAIL'}: tokens equal before the first "
        f"difference {agreed} of {args.max_tokens}; chosen-token logprobs within {worst:.1e} "
        f"(tolerance {LOGPROB_TOL:g}); kernels vs reference path on {args.device} "
        f"({time.perf_counter() - t0:.1f} s)"
    )
    if not ok:
        for i, (r, g) in enumerate(zip(ref, got)):
            print(f"[{model} {scheme}] prompt {i}: reference {r} kernels {g}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="tiny,rag", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated: {SCHEMES}")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    schemes = [s for s in args.schemes.split(",") if s]
    bad = [m for m in models if m not in MODELS] + [s for s in schemes if s not in SCHEMES]
    if bad:
        p.error(f"unknown {', '.join(bad)}: models are {list(MODELS)}, schemes {list(SCHEMES)}")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both paths
    results = [check(m, s, args) for m in models for s in schemes]
    print(f"quant greedy: {sum(results)} of {len(results)} model x scheme checks pass")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

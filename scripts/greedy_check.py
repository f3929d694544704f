"""Greedy tokens of kvbatch against transformers, in float32, on random-weight Llama models.

    python scripts/greedy_check.py --device cuda --backend triton --models tiny,rag
    python scripts/greedy_check.py --device cpu --models tiny          # the same on the CPU

For each model (`tiny`: benchmarks.models.TINY_LLAMA; `rag`: Llama-3.2-1B's shape built from
its config, the `rag` benchmark's model) the same prompts run through kvbatch
(engine.LLM(attention_backend=...), float32) and through transformers' `generate` (float32,
one prompt at a time, no padding), and the greedy tokens must be equal. The prompts cover
what the paged kernels must get right: lengths off block boundaries, a pair sharing a
two-block prefix (the second request reads the first one's cached blocks), and prompts longer
than one step's token budget (chunked prefill). Exit status 0 when every prompt matches, 1
otherwise; the output names the first differing position.

Random models can have near-tied logits where a correct implementation flips a token on
float rounding; TF32 is turned off here so that float32 means float32 on both sides.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks.models import LLAMA_3_2_1B, TINY_LLAMA, ModelSpec, random_model_dir  # noqa: E402

MODELS: dict[str, ModelSpec] = {"tiny": TINY_LLAMA, "rag": LLAMA_3_2_1B}
BLOCK_SIZE = 16
STEP_TOKENS = 64  # tokens per engine step: the 100+ token prompts are prefilled in chunks


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Five prompts: odd lengths, a shared 2-block prefix, and two longer than a step."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return rng.integers(3, vocab_size, size=n).tolist()

    shared = draw(2 * BLOCK_SIZE)
    return [
        draw(7),
        shared + draw(5),
        shared + draw(19),  # its first 2 blocks come from the previous prompt's cache
        draw(STEP_TOKENS + 37),  # 101 tokens: two chunks
        draw(3 * STEP_TOKENS + 1),  # 193 tokens: four chunks, the last of one token
    ]


def kvbatch_tokens(path: Path, prompts, max_tokens: int, device: str, backend: str):
    from engine import LLM, SamplingParams

    llm = LLM(
        model=str(path),
        device=device,
        dtype="float32",
        attention_backend=backend,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=STEP_TOKENS,
        max_model_len=1024,
        kv_cache_bytes=1 << 30,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # One at a time in order, so the third prompt finds the second's blocks in the cache,
    # then all together (decodes batched with chunked prefills).
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hit = llm.stats().prefix_hit_rate
    del llm
    return [list(t) for t in alone], [list(t) for t in batched], hit


def transformers_tokens(path: Path, prompts, max_tokens: int, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa"
    )
    model = model.to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=None,
                pad_token_id=0,
            )
            out.append(gen[0, len(p) :].tolist())
    del model
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_model(name: str, args: argparse.Namespace) -> bool:
    spec = MODELS[name]
    t0 = time.perf_counter()
    path = random_model_dir(spec)
    print(f"[{name}] model {spec.name} ({spec.num_parameters() / 1e6:.1f} M parameters): {path}")
    prompts = make_prompts(spec.vocab_size, seed=args.seed)
    ref = transformers_tokens(path, prompts, args.max_tokens, args.device)
    _free()
    alone, batched, hit = kvbatch_tokens(path, prompts, args.max_tokens, args.device, args.backend)
    _free()
    ok = True
    for i, p in enumerate(prompts):
        for label, got in (("alone", alone[i]), ("batched", batched[i])):
            diff = first_difference(ref[i], got)
            if diff is not None:
                ok = False
                print(
                    f"[{name}] prompt {i} ({len(p)} tokens, {label}): MISMATCH at token {diff}: "
                    f"transformers {ref[i]} kvbatch {got}"
                )
    matched = "all match" if ok else "MISMATCH"
    print(
        f"[{name}] {len(prompts)} prompts x {args.max_tokens} tokens, alone and batched: "
        f"{matched} (backend {args.backend}, {args.device}, prefix hit rate {hit:.2f}, "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    return ok


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backend", help="kvbatch attention_backend (default: triton on CUDA, auto on the CPU)"
    )
    p.add_argument("--models", default="tiny,rag", help=f"comma-separated: {', '.join(MODELS)}")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "triton" if args.device.startswith("cuda") else "auto"
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        p.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {}
    for name in names:
        try:
            results[name] = check_model(name, args)
        except Exception as e:  # report and go on to the next model
            print(f"[{name}] ERROR: {type(e).__name__}: {e}")
            results[name] = False
        _free()
    verdict = "PASS" if all(results.values()) else "FAIL"
    summary = ", ".join(f"{n} {'ok' if v else 'FAIL'}" for n, v in results.items())
    print(f"greedy check {verdict}: {summary}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

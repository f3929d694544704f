"""Greedy tokens of kvbatch against transformers, in float32, on random-weight Llama models.

    python scripts/greedy_check.py --device cuda --backend triton --models tiny,rag
    python scripts/greedy_check.py --device cpu --models tiny          # the same on the CPU

For each model (`tiny`: kvbatch.bench.models.TINY_LLAMA; `rag`: Llama-3.2-1B's shape built from
its config, the `rag` benchmark's model; `tiny-moe`: a tiny Qwen3-MoE, whose experts run in the
fused MoE kernel; `tiny-gpt-oss`: a tiny gpt-oss with MXFP4 experts, sinks and windows, which
transformers reads dequantized) the same prompts run through kvbatch
(engine.LLM(attention_backend=...), float32) and through transformers' `generate` (float32,
one prompt at a time, no padding), and the greedy tokens must be equal. The prompts cover
what the paged kernels must get right: lengths off block boundaries, a pair sharing a
two-block prefix (the second request reads the first one's cached blocks), and prompts longer
than one step's token budget (chunked prefill). Exit status 0 when every prompt matches, 1
otherwise; the output names the first differing position.

Logits are compared too: for every prompt run alone, kvbatch's log-probability of each
token it chose (SamplingParams.logprobs) against transformers' (log-softmax of
`generate(output_logits=True)`), over the positions where the tokens agree; the check fails
when they differ by more than LOGPROB_TOL. Random models can have near-tied logits where a
correct implementation flips a token on float rounding: a first difference where
transformers scores kvbatch's token within TIE_TOL of its own is reported as a near tie (and
passes; the two continuations diverge from there, so nothing after it is compared), any
other difference fails. TF32 is turned off here so that float32 means float32 on both sides.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvbatch.bench.hf_peers import mxfp4_dequantized  # noqa: E402
from kvbatch.bench.models import (  # noqa: E402
    LLAMA_3_2_1B,
    TINY_GPT_OSS,
    TINY_LLAMA,
    TINY_QWEN3_MOE,
    ModelSpec,
    random_model_dir,
)

MODELS: dict[str, ModelSpec] = {
    "tiny": TINY_LLAMA,
    "rag": LLAMA_3_2_1B,
    "tiny-moe": TINY_QWEN3_MOE,
    "tiny-gpt-oss": TINY_GPT_OSS,
}
BLOCK_SIZE = 16
STEP_TOKENS = 64  # tokens per engine step: the 100+ token prompts are prefilled in chunks
LOGPROB_TOL = 2e-3  # float32 both sides: |logprob difference| of a chosen token
TIE_TOL = 1e-3  # transformers' logprob of its token minus of kvbatch's, to call a flip a tie


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
    from kvbatch.engine import LLM, SamplingParams

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
    scored = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    # One at a time in order, so the third prompt finds the second's blocks in the cache
    # (with logprobs: the sampler's path), then all together (decodes batched with chunked
    # prefills; greedy without logprobs: the argmax path).
    alone = [llm.generate([p], scored, use_tqdm=False)[0].outputs[0] for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hit = llm.stats().prefix_hit_rate
    del llm
    logprobs = [[lp.logprob for lp in o.logprobs] for o in alone]
    return [list(o.token_ids) for o in alone], logprobs, [list(t) for t in batched], hit


def transformers_tokens(path: Path, prompts, max_tokens: int, device: str):
    from transformers import AutoModelForCausalLM

    # MXFP4 experts (gpt-oss) read through transformers' own dequantization
    kw = dict(dtype=torch.float32, attn_implementation="sdpa", **mxfp4_dequantized(path))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    except ValueError as e:  # gpt-oss (its sinks) has no SDPA path
        if "does not support an attention implementation" not in str(e):
            raise
        model = AutoModelForCausalLM.from_pretrained(
            str(path), **kw | {"attn_implementation": "eager"}
        )
    model = model.to(device).eval()
    out, logprobs = [], []
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
                output_logits=True,
                return_dict_in_generate=True,
            )
            out.append(gen.sequences[0, len(p) :].tolist())
            # [steps, vocab]: log-probabilities of every token at every generated position
            rows = torch.stack([step[0].float() for step in gen.logits])
            logprobs.append(torch.log_softmax(rows, dim=-1).cpu().numpy())
    del model
    return out, logprobs


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Comparison(NamedTuple):
    verdict: str  # "match", "near tie", "mismatch" or "logprobs differ"
    first_difference: int | None
    max_logprob_error: float  # over the positions compared (before the first difference)
    tie_margin: float | None  # at the first difference: transformers' own token minus kvbatch's


def compare(
    ref: list[int], ref_logprobs: np.ndarray, got: list[int], got_logprobs: list[float] | None
) -> Comparison:
    """kvbatch's tokens (and chosen-token logprobs, if given) against transformers' tokens and
    full log-softmax rows ([positions, vocab])."""
    diff = first_difference(ref, got)
    upto = len(ref) if diff is None else diff
    error = 0.0
    if got_logprobs is not None and upto:
        expected = ref_logprobs[np.arange(upto), ref[:upto]]
        error = float(np.max(np.abs(expected - np.asarray(got_logprobs[:upto]))))
    margin = None
    if diff is not None and diff < min(len(ref), len(got)):
        row = ref_logprobs[diff]
        margin = float(row[ref[diff]] - row[got[diff]])
    if diff is None:
        verdict = "match"
    elif margin is not None and margin <= TIE_TOL:
        verdict = "near tie"
    else:
        verdict = "mismatch"
    if verdict != "mismatch" and error > LOGPROB_TOL:
        verdict = "logprobs differ"
    return Comparison(verdict, diff, error, margin)


def check_model(name: str, args: argparse.Namespace) -> tuple[bool, float]:
    """(every prompt matched or flipped only at a near tie, the worst logprob difference)"""
    spec = MODELS[name]
    t0 = time.perf_counter()
    path = random_model_dir(spec)
    print(f"[{name}] model {spec.name} ({spec.num_parameters() / 1e6:.1f} M parameters): {path}")
    prompts = make_prompts(spec.vocab_size, seed=args.seed)
    ref, ref_logprobs = transformers_tokens(path, prompts, args.max_tokens, args.device)
    _free()
    alone, alone_logprobs, batched, hit = kvbatch_tokens(
        path, prompts, args.max_tokens, args.device, args.backend
    )
    _free()
    ok, ties, worst = True, 0, 0.0
    for i, p in enumerate(prompts):
        runs = (("alone", alone[i], alone_logprobs[i]), ("batched", batched[i], None))
        for label, got, got_logprobs in runs:
            c = compare(ref[i], ref_logprobs[i], got, got_logprobs)
            worst = max(worst, c.max_logprob_error)
            if c.verdict == "match":
                continue
            ok = ok and c.verdict == "near tie"
            ties += c.verdict == "near tie"
            margin = "" if c.tie_margin is None else f", transformers' margin {c.tie_margin:.2e}"
            print(
                f"[{name}] prompt {i} ({len(p)} tokens, {label}): {c.verdict.upper()} at token "
                f"{c.first_difference} (max |logprob diff| {c.max_logprob_error:.2e}{margin}): "
                f"transformers {ref[i]} kvbatch {got}"
            )
    matched = "all match" if ok and not ties else ("match but for near ties" if ok else "FAIL")
    print(
        f"[{name}] {len(prompts)} prompts x {args.max_tokens} tokens, alone and batched: "
        f"{matched}; chosen-token logprobs within {worst:.1e} of transformers' (tolerance "
        f"{LOGPROB_TOL:g}) (backend {args.backend}, {args.device}, prefix hit rate {hit:.2f}, "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    return ok, worst


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
            results[name] = (False, float("nan"))
        _free()
    verdict = "PASS" if all(ok for ok, _ in results.values()) else "FAIL"
    summary = ", ".join(
        f"{n} {'ok' if ok else 'FAIL'} (logprobs within {worst:.1e})"
        for n, (ok, worst) in results.items()
    )
    print(f"greedy check {verdict}: {summary}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

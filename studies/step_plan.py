"""`step-plan`: the steps the scheduler makes of a workload, without running a model.

    python -m studies step-plan [WORKLOAD] [--max-num-seqs 256,512] [--max-num-batched-tokens 8192]

How many steps a job takes, and of which kind, depends on the scheduler alone: max_num_seqs
decides whether `rag`'s 512 requests decode in one wave or two, max_num_batched_tokens how
many prefill steps the prompts need, and prefix caching how many prompt tokens are computed
at all. This runs the real engine (scheduler, KV manager with its prefix cache, runner) on the
workload's prompts with the model's forward replaced by zeros, so a plan for the `rag` shape
takes seconds on a CPU, and prints per cell: steps, decode-only steps, prefill-only and mixed
steps, and prompt tokens computed against the workload's total. Read it beside a GPU sweep
(`kvbatch bench rag --sweep`): a decode step costs about the same at 256 and 512 sequences
on a small model, so halving the decode steps is most of what more sequences buy.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from kvbatch.bench.text_table import format_rows
from kvbatch.bench.workloads import Workload, get_workload


def plan(workload: Workload, max_num_seqs: int, max_num_batched_tokens: int) -> dict[str, Any]:
    """The step plan of one cell: the scheduler's steps over the workload, model stubbed."""
    import torch

    from kvbatch.bench.models import TINY_LLAMA, random_model_dir
    from kvbatch.bench.workloads import TINY_RANDOM, make_prompts
    from kvbatch.engine import LLM, SamplingParams

    # Chunks of long prompts are capped in tokens' worth of compute, which depends on the
    # model's shape (ModelConfig.attention_break_even_context): plan with the real model's.
    break_even = _break_even_context(workload.model)
    w = dataclasses.replace(workload, model=TINY_RANDOM)
    if w.has_long_prompt:
        raise ValueError(f"{w.name} adds a prompt mid-run: plan a workload without one")
    prompts = make_prompts(w, TINY_LLAMA.vocab_size)
    llm = LLM(
        str(random_model_dir(TINY_LLAMA)),
        attention_backend="torch",
        async_scheduling=False,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        # room for every running request's own blocks, as on a large GPU: nobody is preempted
        num_kv_blocks=max_num_seqs * -(-(w.prompt_len + w.output_len) // 16) + 16,
        block_size=16,
        max_model_len=w.prompt_len + w.output_len,
    )
    engine = llm.engine
    if break_even is not None:
        engine.scheduler.config = dataclasses.replace(
            engine.scheduler.config, attention_break_even_context=break_even
        )
    vocab = TINY_LLAMA.vocab_size
    # the forward's logits rows, all zeros: scheduling, KV and the runner's host side run as is
    engine.runner._forward = lambda key, ids, meta, rows: torch.zeros(len(rows), vocab)
    schedule = engine.scheduler.schedule
    steps: list[tuple[int, int]] = []  # (decodes, prompt tokens) per step

    def recorded():
        out = schedule()
        decodes = sum(1 for c in out.chunks if c.num_new_tokens == 1 and c.seq.num_output_tokens)
        steps.append((decodes, out.num_tokens - decodes))
        return out

    engine.scheduler.schedule = recorded
    llm.generate(prompts, SamplingParams(max_tokens=w.output_len, ignore_eos=True), use_tqdm=False)
    return {
        "workload": w.name,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "steps": len(steps),
        "decode_steps": sum(1 for d, p in steps if p == 0),
        "prefill_steps": sum(1 for d, p in steps if d == 0 and p),
        "mixed_steps": sum(1 for d, p in steps if d and p),
        "prompt_tokens_computed": sum(p for _, p in steps),
        "prompt_tokens": sum(len(p) for p in prompts),
    }


def _break_even_context(model: str) -> int | None:
    """The attention break-even context of a workload's random model (None for a model that
    is not built from a config here, e.g. SmolLM2's GGUF: the tiny model's is kept)."""
    from kvbatch.bench.models import MODEL_SPECS
    from kvbatch.engine.models.llama import ModelConfig

    spec = MODEL_SPECS.get(model)
    return None if spec is None else ModelConfig.from_hf(spec.config()).attention_break_even_context


def format_plans(plans: list[dict[str, Any]]) -> str:
    rows = [
        ("seqs", "tokens/step", "steps", "decode", "prefill", "mixed", "prompt tokens computed")
    ]
    for p in plans:
        share = p["prompt_tokens_computed"] / p["prompt_tokens"]
        rows.append(
            (
                str(p["max_num_seqs"]),
                str(p["max_num_batched_tokens"]),
                str(p["steps"]),
                str(p["decode_steps"]),
                str(p["prefill_steps"]),
                str(p["mixed_steps"]),
                f"{p['prompt_tokens_computed']} of {p['prompt_tokens']} ({share:.0%})",
            )
        )
    return "\n".join(
        [f"{plans[0]['workload']}: the scheduler's steps (model stubbed)", ""] + format_rows(rows)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies step-plan", description=__doc__)
    ap.add_argument("workload", nargs="?", default="rag")
    ap.add_argument("--tiny", action="store_true", help="the workload's tiny variant")
    ap.add_argument("--max-num-seqs", default="256,512", metavar="N,N")
    ap.add_argument("--max-num-batched-tokens", default="8192,16384", metavar="N,N")
    args = ap.parse_args(argv)
    try:
        seqs = [int(x) for x in args.max_num_seqs.split(",")]
        tokens = [int(x) for x in args.max_num_batched_tokens.split(",")]
        workload = get_workload(args.workload, tiny=args.tiny)
        plans = [plan(workload, s, t) for s in seqs for t in tokens]
    except ValueError as e:
        ap.error(str(e))
    print(format_plans(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`host-overhead`: the engine's host (Python) time per decode step, phase by phase.

    kvbatch bench host-overhead [--requests 512] [--backend torch] [--no-cascade]
                                [--async-scheduling] [--json F]

On a GPU a decode step of the `rag` workload takes a few milliseconds, and the host builds
the next step only after the sampled tokens are back: every millisecond of scheduling and
tensor preparation is a millisecond the GPU waits, 64 times per request. This measures that
host time on the CPU, where it is the same Python: `rag`'s shape (512 requests, 16 documents
x 32 chunks, prompts of 1,184 tokens, 64 output tokens) on the tiny random model, so the
forward itself is cheap and reported apart. Phases per decode step (prefill steps excluded):

    schedule   Scheduler.schedule: which sequences run, block allocation
    prepare    ModelRunner._prepare: token ids, positions, slots, block tables, cascade groups,
               the host-to-device copy
    forward    the model (not host overhead; here the tiny model on the CPU)
    sample     sampling tensors, the sampler, tokens back to the host
    rest       appending tokens, stop checks, finishing requests (step minus the above)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from benchmarks.step_profile import PHASES, StepProfile


def measure(
    requests: int = 512,
    backend: str = "torch",
    cascade: bool = True,
    output_len: int = 64,
    threads: int = 1,
    async_scheduling: bool = False,
) -> dict[str, Any]:
    import torch

    from benchmarks.models import TINY_LLAMA, random_model_dir
    from benchmarks.workloads import TINY_RANDOM, get_workload, make_prompts
    from engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    rag = get_workload("rag")
    chunks = rag.chunks_per_document
    workload = dataclasses.replace(
        rag,
        model=TINY_RANDOM,
        num_documents=max(1, requests // chunks),
        chunks_per_document=min(chunks, requests),
        output_len=output_len,
    )
    prompts = make_prompts(workload, TINY_LLAMA.vocab_size)
    llm = LLM(
        str(random_model_dir(TINY_LLAMA)),
        attention_backend=backend,
        cascade_attention=cascade,
        async_scheduling=async_scheduling,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=16384,
        kv_cache_bytes=2 << 30,
        max_model_len=workload.prompt_len + output_len + 16,
    )
    engine = llm.engine
    profile = StepProfile(engine)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    for p in prompts:
        engine.add_request(p, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
        engine.step()  # prefill (and the first tokens): not what this measures
    profile.clear()
    while engine.has_unfinished():
        engine.step()
    summary = profile.summary()
    phases = summary["ms_per_step"]
    return {
        "requests": len(prompts),
        "backend": backend,
        "cascade": cascade,
        "async_scheduling": async_scheduling,
        "decode_steps": summary["steps"],
        "ms_per_step": phases,
        # medians of schedule + prepare + sample + rest: the host's share of a step on the
        # CPU, where the forward runs synchronously (on a GPU, sample includes the GPU's wait)
        "host_ms_per_step": sum(v for k, v in phases.items() if k != "forward"),
        "torch": torch.__version__,
    }


def format_result(r: dict[str, Any]) -> str:
    head = (
        f"host-overhead: {r['requests']} requests at rag's shape on the tiny model, "
        f"{r['backend']} backend, cascade {'on' if r['cascade'] else 'off'}, "
        f"async scheduling {'on' if r.get('async_scheduling') else 'off'}, "
        f"{r['decode_steps']} decode steps"
    )
    rows = [f"| {k} | {r['ms_per_step'][k]:.2f} |" for k in PHASES]
    return "\n".join(
        [
            head,
            "",
            "| phase | ms per decode step (median) |",
            "|---|---|",
            *rows,
            f"| host total (all but forward) | {r['host_ms_per_step']:.2f} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbatch bench host-overhead", description=__doc__)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--backend", default="torch", help="torch, or triton (TRITON_INTERPRET=1)")
    ap.add_argument("--no-cascade", action="store_true", help="shared-prefix attention off")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the GPU's default: each step queued before the previous step's tokens arrive "
        "(on the CPU nothing overlaps; this measures its bookkeeping)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.output_len < 2:
        ap.error("--requests must be >= 1 and --output-len >= 2")
    result = measure(
        args.requests,
        args.backend,
        not args.no_cascade,
        args.output_len,
        args.threads,
        args.async_scheduling,
    )
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

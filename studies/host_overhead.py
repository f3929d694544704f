"""`host-overhead`: the engine's host (Python) time per decode step, phase by phase.

    python -m studies host-overhead [--requests 512] [--backend torch] [--no-cascade]
                                [--async-scheduling] [--json F]
    python -m studies host-overhead --long-prompt 32768 [--requests 64] [--chunk-tokens 256]
                                [--long-decode-steps 32]

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
import statistics
import sys
import time
from typing import Any

from kvbatch.bench.step_profile import PHASES, StepProfile


def measure(
    requests: int = 512,
    backend: str = "torch",
    cascade: bool = True,
    output_len: int = 64,
    threads: int = 1,
    async_scheduling: bool = False,
) -> dict[str, Any]:
    import torch

    from kvbatch.bench.models import TINY_LLAMA, random_model_dir
    from kvbatch.bench.workloads import TINY_RANDOM, get_workload, make_prompts
    from kvbatch.engine import LLM, SamplingParams

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


DECODE_TOKENS = 4096


def measure_long_prompt(
    long_prompt_len: int = 32768,
    decoders: int = 64,
    chunk_tokens: int = 256,
    plain_steps: int = 10,
    threads: int = 1,
    long_decode_steps: int = 32,
) -> dict[str, Any]:
    """Host phases of the long-prefill shape: `decoders` requests decode; after `plain_steps`
    profiled plain steps a `long_prompt_len`-token prompt arrives and is prefilled in chunks
    of at most `chunk_tokens` tokens' worth beside them (the token cap, the same split every
    run); then it decodes beside them for `long_decode_steps` steps. Whether the host's work
    per step (schedule, prepare, rest) grows while a long prompt is in flight, and once its
    table (2,048 blocks at 32k) is one of the decodes': on a GPU those phases are the part of
    a step that graphs and chunk sizes do not shorten, and with async scheduling the first
    long-decoding step is prepared in the call that collects the prompt's last chunk. The
    prompt's add_request is timed apart (it falls between two steps)."""
    import random

    import torch

    from kvbatch.bench.models import TINY_LLAMA, random_model_dir
    from kvbatch.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    positions = long_prompt_len + max(64, long_decode_steps + 32)
    spec = dataclasses.replace(
        TINY_LLAMA,
        name=f"{TINY_LLAMA.name}-ctx{positions}",
        max_position_embeddings=max(TINY_LLAMA.max_position_embeddings, positions),
    )
    max_model_len = long_prompt_len + long_decode_steps + 16
    # the decoders outlast a prefill of up to DECODE_TOKENS steps (a 32k prompt: 468 steps at
    # --chunk-tokens 4096; at 256 the cap's chunks shrink with depth and it took 4,090), and
    # then the long prompt's decodes
    decode_len = min(DECODE_TOKENS + long_decode_steps, max_model_len - 128)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(128)] for _ in range(decoders)]
    llm = LLM(
        str(random_model_dir(spec)),
        max_num_seqs=decoders + 1,
        max_model_len=max_model_len,
        long_prefill_token_threshold=chunk_tokens,
        num_kv_blocks=-(-max_model_len // 16) + decoders * -(-(128 + decode_len) // 16) + 16,
    )
    engine = llm.engine
    decode = SamplingParams(max_tokens=decode_len, ignore_eos=True, temperature=0)
    for p in prompts:
        engine.add_request(p, decode)
    engine.step()  # the decoders' prompts (and first tokens)
    profile = StepProfile(engine)
    for _ in range(plain_steps):
        engine.step()
    plain = list(profile.steps)
    long_prompt = [rng.randrange(3, spec.vocab_size) for _ in range(long_prompt_len)]
    start = time.perf_counter()
    long_params = dataclasses.replace(decode, max_tokens=long_decode_steps + 1)  # greedy too
    rid = engine.add_request(long_prompt, long_params)
    add_ms = (time.perf_counter() - start) * 1e3
    long_seq = engine.requests[rid]
    profile.clear()
    while long_seq.num_output_tokens == 0:
        engine.step()
    mixed = list(profile.steps)
    profile.clear()
    for _ in range(long_decode_steps):
        engine.step()
    long_decoding = list(profile.steps)

    def medians(steps: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(s[k] for s in steps) * 1e3 for k in PHASES}

    def maxima(steps: list[dict[str, float]]) -> dict[str, float]:
        return {k: max(s[k] for s in steps) * 1e3 for k in PHASES}

    return {
        "decoders": decoders,
        "long_prompt_len": long_prompt_len,
        "chunk_tokens": chunk_tokens,
        "add_request_ms": add_ms,
        "plain_steps": len(plain),
        "mixed_steps": len(mixed),
        "plain_ms_per_step": medians(plain),
        "mixed_ms_per_step": medians(mixed),
        "mixed_max_ms": maxima(mixed),
        "long_decoding_steps": len(long_decoding),
        "long_decoding_ms_per_step": medians(long_decoding) if long_decoding else None,
        "long_decoding_max_ms": maxima(long_decoding) if long_decoding else None,
        "torch": torch.__version__,
    }


def format_long_prompt_result(r: dict[str, Any]) -> str:
    columns = [
        ("plain step (median ms)", r["plain_ms_per_step"]),
        ("with a chunk (median ms)", r["mixed_ms_per_step"]),
        ("with a chunk (max ms)", r["mixed_max_ms"]),
    ]
    if r.get("long_decoding_ms_per_step"):
        columns += [
            ("long decoding (median ms)", r["long_decoding_ms_per_step"]),
            ("long decoding (max ms)", r["long_decoding_max_ms"]),
        ]
    rows = ["| " + " | ".join([k, *(f"{c[k]:.2f}" for _, c in columns)]) + " |" for k in PHASES]
    return "\n".join(
        [
            f"host-overhead --long-prompt {r['long_prompt_len']}: {r['decoders']} decoders on "
            f"the tiny model, chunks of at most {r['chunk_tokens']} tokens' worth; "
            f"{r['plain_steps']} plain steps, {r['mixed_steps']} while the prompt was prefilled, "
            f"{r.get('long_decoding_steps', 0)} while it decoded beside the others; "
            f"its add_request {r['add_request_ms']:.2f} ms",
            "",
            "| phase | " + " | ".join(name for name, _ in columns) + " |",
            "|---" * (len(columns) + 1) + "|",
            *rows,
        ]
    )


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
    ap = argparse.ArgumentParser(prog="python -m studies host-overhead", description=__doc__)
    ap.add_argument(
        "--requests", type=int, help="requests (default 512; with --long-prompt, 64 decoders)"
    )
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--backend", default="torch", help="torch, or triton (TRITON_INTERPRET=1)")
    ap.add_argument("--no-cascade", action="store_true", help="shared-prefix attention off")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the GPU's default: each step queued before the previous step's tokens arrive "
        "(on the CPU nothing overlaps; this measures its bookkeeping)",
    )
    ap.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        metavar="N",
        help="instead: 64 decoders (--requests) while an N-token prompt is prefilled in chunks "
        "of --chunk-tokens, host phases of plain steps against steps with a chunk",
    )
    ap.add_argument("--chunk-tokens", type=int, default=256, help="with --long-prompt")
    ap.add_argument(
        "--long-decode-steps",
        type=int,
        default=32,
        help="with --long-prompt: steps profiled after its first token, while it decodes",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = ap.parse_args(argv)
    requests = args.requests or (64 if args.long_prompt else 512)
    if requests < 1 or args.output_len < 2:
        ap.error("--requests must be >= 1 and --output-len >= 2")
    if args.long_prompt:
        if args.long_prompt < 2 or args.chunk_tokens < 1 or args.long_decode_steps < 0:
            ap.error("--long-prompt must be >= 2, --chunk-tokens >= 1 and --long-decode-steps >= 0")
        result = measure_long_prompt(
            args.long_prompt,
            requests,
            args.chunk_tokens,
            threads=args.threads,
            long_decode_steps=args.long_decode_steps,
        )
        print(format_long_prompt_result(result))
        _write_json(args.json, result)
        return 0
    result = measure(
        requests,
        args.backend,
        not args.no_cascade,
        args.output_len,
        args.threads,
        args.async_scheduling,
    )
    print(format_result(result))
    _write_json(args.json, result)
    return 0


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())

"""`spec-copy`: speculative decoding on prompts that ask to repeat or extract their own text.

    python -m kvbatch.bench.spec_copy [--model PATH] [--speculative ngram|draft:PATH] [-k 4]

SmolLM2-135M-Instruct on the CPU by default. One engine; speculation is switched on and off
between runs (same weights, same KV pool), and the runs are interleaved: for each repeat,
batch 1 (requests one at a time) without and with speculation, then one batch of `--batch`
requests without and with. Ratios are paired within a repeat. Output tokens are compared
between the two modes (greedy: they must be identical).

Prompts are chat-formatted: "repeat this passage", "copy the sentences that mention X",
"turn this list into ...", each holding a passage of a few sentences, so the answer copies
long runs of the prompt (what n-gram lookup can propose).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

PASSAGES = [
    "The lighthouse on the northern cape was built in 1874 from granite quarried on the "
    "island itself. Its lamp burned whale oil until 1902, then kerosene, and since 1961 it "
    "has been electric. The keeper's cottage now houses a small museum with the original "
    "lens, a logbook of storms, and photographs of the families who lived there.",
    "To make the bread, mix five hundred grams of flour with ten grams of salt and seven "
    "grams of dried yeast. Add three hundred and fifty millilitres of warm water and knead "
    "for ten minutes until the dough is smooth. Leave it to rise for an hour, shape it into "
    "a loaf, and bake it at two hundred and twenty degrees for thirty five minutes.",
    "The committee met on Tuesday to review the budget for the coming year. It approved new "
    "funding for the library and the swimming pool, postponed the repairs to the town hall "
    "roof, and asked the treasurer to prepare a report on parking fees before the next "
    "meeting in March.",
    "Honey bees communicate the location of flowers with a waggle dance. The angle of the "
    "dance relative to vertical shows the direction of the food relative to the sun, and the "
    "length of the waggle run shows the distance. Other bees follow the dancer and then fly "
    "out to find the flowers on their own.",
    "Our support team is available from Monday to Friday between nine in the morning and six "
    "in the evening. For urgent problems outside these hours, please call the emergency "
    "number printed on the back of your card. Refunds are processed within five working "
    "days, and you will receive an email when the money has been sent.",
    "The river rises in the western hills and flows east for about two hundred kilometres "
    "before it reaches the sea. Along the way it passes three market towns, turns the wheels "
    "of several old mills, and feeds a wide marsh where herons, egrets and otters live all "
    "year round.",
    "Before you start the machine, check that the water tank is full and the filter is clean. "
    "Press the power button once and wait for the green light. Choose the programme with the "
    "dial, then press start. When the cycle ends, the machine beeps three times and the door "
    "unlocks after one minute.",
    "The museum's new exhibition tells the story of the city's trams, from horse-drawn cars "
    "in the eighteen eighties to the electric lines that closed in nineteen fifty six. "
    "Visitors can sit in a restored tram, operate a model signal box, and listen to "
    "recordings of drivers and conductors describing their work.",
]

TASKS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Copy this passage without changing anything:\n\n{p}",
    "Here is a passage:\n\n{p}\n\nWrite the passage out again, exactly as it is.",
    "Rewrite the following text as it is, sentence by sentence:\n\n{p}",
]


def copy_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts (token ids), cycling over tasks x passages."""
    out = []
    for i in range(n):
        task = TASKS[(i // len(PASSAGES)) % len(TASKS)]
        text = task.format(p=PASSAGES[i % len(PASSAGES)])
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(chat))
    return out


@dataclass
class Run:
    mode: str  # "off" or the speculative method
    batch: int
    seconds: float
    cpu_seconds: float  # this process's CPU time: robust to other load on a shared machine
    tokens: int
    draft_tokens: int
    accepted_tokens: int
    verifications: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_seconds


def _timed(llm, spec, prompts, params, batch: int, mode: str):
    """Generate `prompts` in groups of `batch` with speculation `spec` (None: off)."""
    engine = llm.engine
    engine.spec = spec
    before = spec.stats if spec is not None else None
    drafted0 = before.num_draft_tokens if before else 0
    accepted0 = before.num_accepted_tokens if before else 0
    verif0 = before.num_verifications if before else 0
    outs = []
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i : i + batch], params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    ids = [o.outputs[0].token_ids for o in outs]
    s = spec.stats if spec is not None else None
    return Run(
        mode,
        batch,
        seconds,
        cpu,
        sum(len(t) for t in ids),
        (s.num_draft_tokens - drafted0) if s else 0,
        (s.num_accepted_tokens - accepted0) if s else 0,
        (s.num_verifications - verif0) if s else 0,
    ), ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbatch bench spec-copy",
        description="Speculative decoding on copy-heavy prompts: tokens/s with and without.",
    )
    p.add_argument("--model", help="Hugging Face folder or .gguf (default: SmolLM2-135M)")
    p.add_argument("--speculative", default="ngram", help="ngram or draft:PATH (default ngram)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--single", type=int, default=4, help="requests run one at a time (4)")
    p.add_argument("--batch", type=int, default=32, help="requests in the batched run (32)")
    p.add_argument(
        "--batch-sizes",
        help="comma-separated batch sizes to measure instead of 1 and --batch (crossover)",
    )
    p.add_argument("--repeat", type=int, default=1, help="interleaved repeats (1)")
    p.add_argument(
        "--max-batch-size",
        type=int,
        help="SpecConfig.max_batch_size (default: the engine's); a large value forces "
        "speculation at every batch size",
    )
    p.add_argument("--threads", type=int, help="torch threads (torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", help="also write the results as JSON to this path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import dataclasses

    import torch

    from kvbatch.engine import LLM, SamplingParams
    from kvbatch.engine.core.config import SpecConfig
    from kvbatch.engine.spec.decoder import build_spec_decoder

    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from kvbatch.fetch import smollm2_dir

        model = str(smollm2_dir())
    spec_config = SpecConfig.parse(args.speculative, args.num_speculative_tokens)
    if args.max_batch_size is not None:
        spec_config = dataclasses.replace(spec_config, max_batch_size=args.max_batch_size)
    sizes = [int(x) for x in args.batch_sizes.split(",")] if args.batch_sizes else [1, args.batch]
    llm = LLM(model=model, device=args.device, max_num_seqs=max(sizes), speculative=spec_config)
    spec = llm.engine.spec
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    prompts = {b: copy_prompts(llm.tokenizer, args.single if b == 1 else b) for b in sizes}
    # Warm up both modes (and the prefix cache, so neither mode is the first to prefill).
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    for b in sizes:
        llm.engine.spec = None
        llm.generate(prompts[b], warm, use_tqdm=False)
        llm.engine.spec = build_spec_decoder(spec_config, llm.engine) if spec is None else spec
        llm.generate(prompts[b][:2], warm, use_tqdm=False)
    spec = llm.engine.spec
    rows: dict[int, list[tuple[Run, Run]]] = {b: [] for b in sizes}
    mismatches = 0
    for rep in range(args.repeat):
        for b in sizes:
            pair = {}
            order = ("off", "on") if rep % 2 == 0 else ("on", "off")
            for mode in order:
                run, ids = _timed(llm, spec if mode == "on" else None, prompts[b], params, b, mode)
                pair[mode] = (run, ids)
            mismatches += sum(a != c for a, c in zip(pair["off"][1], pair["on"][1]))
            rows[b].append((pair["off"][0], pair["on"][0]))
            off, on = pair["off"][0], pair["on"][0]
            print(
                f"repeat {rep} batch {b}: off {off.tokens_per_s:.1f} tok/s, "
                f"{args.speculative} {on.tokens_per_s:.1f} tok/s "
                f"({on.tokens_per_s / off.tokens_per_s:.2f}x; per CPU second "
                f"{on.tokens_per_cpu_s / off.tokens_per_cpu_s:.2f}x)",
                file=sys.stderr,
            )
    llm.engine.spec = spec
    table = _table(rows, args, model, mismatches)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": model,
                    "speculative": args.speculative,
                    "k": args.num_speculative_tokens,
                    "max_batch_size": spec_config.max_batch_size,
                    "threads": torch.get_num_threads(),
                    "mismatched_requests": mismatches,
                    "runs": {b: [[asdict(x) for x in pair] for pair in r] for b, r in rows.items()},
                },
                f,
                indent=2,
            )
    return 1 if mismatches else 0


def _table(rows, args, model, mismatches) -> str:
    import torch

    lines = [
        f"spec-copy: {model}, {args.speculative} k={args.num_speculative_tokens}, "
        f"{args.max_tokens} tokens greedy, {args.device}, {torch.get_num_threads()} threads, "
        f"{args.repeat} repeat(s); greedy outputs identical: {'yes' if not mismatches else 'NO'}",
        "",
        "| batch | requests | off tok/s | spec tok/s | speed-up (paired median) "
        "| speed-up per CPU second | acceptance | mean accepted length "
        "| tokens from verifications |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, pairs in rows.items():
        off = statistics.median(p[0].tokens_per_s for p in pairs)
        on = statistics.median(p[1].tokens_per_s for p in pairs)
        ratio = statistics.median(p[1].tokens_per_s / p[0].tokens_per_s for p in pairs)
        cpu_ratio = statistics.median(p[1].tokens_per_cpu_s / p[0].tokens_per_cpu_s for p in pairs)
        drafted = sum(p[1].draft_tokens for p in pairs)
        accepted = sum(p[1].accepted_tokens for p in pairs)
        verif = sum(p[1].verifications for p in pairs)
        tokens = sum(p[1].tokens for p in pairs)
        acc = f"{accepted / drafted:.0%}" if drafted else "-"
        mal = f"{1 + accepted / verif:.2f}" if verif else "-"
        # Each verification emits 1 + accepted tokens: the share of output tokens that came
        # out of verification steps (the rest were plain decodes or first tokens).
        share = f"{(verif + accepted) / tokens:.0%}" if tokens else "-"
        lines.append(
            f"| {b} | {len_requests(b, args)} | {off:.1f} "
            f"| {on:.1f} | {ratio:.2f}x | {cpu_ratio:.2f}x | {acc} | {mal} | {share} |"
        )
    return "\n".join(lines)


def len_requests(b: int, args) -> int:
    return args.single if b == 1 else b


if __name__ == "__main__":
    sys.exit(main())

"""`kvbatch bench mixed-decode`: a decode step's time for rows of one document, and for a
batch that mixes in a row of another, before and after decode attention followed each row's
own length; transformers (static batches) beside it.

The index job's context stage decodes a dozen chunk prompts per document, each prompt the whole
document and then its chunk. Rows of one document share the document's blocks (one cascade
group); a row of another document (its last chunk alone, or the next document's first row) has
no group and holds its whole document privately. Decode attention that pads every row's private
part to the longest row makes that one row cost every row a whole document per layer per step.
This measures, on real text (pydoc pages of the standard library, cut to each document's
length) and with 48 output tokens:

    one document   12 rows sharing a ~1,500-token document
    mixed 11 + 1   11 of those rows and one row of a ~2,000-token document
    several docs   3 documents (1,500, 2,000 and 1,000 tokens) x 12 rows through
                   LLM.generate with a KV pool that holds about one document group: decode
                   ms per step, seconds, and prefill tokens against the ideal

The first two run in --repeat paired rounds (one document, then mixed, on the same engine),
each a decode step's median wall and CPU time (the process's; on shared cores the CPU time
moves less), with the median of the rounds' mixed / one ratios (target: 1.2 at most). Once
each, for comparison: kvbatch as it was ("kvbatch before", `as_before`: rows grouped by first
block, private parts padded to the longest row, shared prefixes gathered every step, the next
group's rows admitted one at a time; fewer output tokens, as its mixed steps are slow),
transformers `generate` on the same 12 prompts in one static batch, and, on the several
documents, transformers `generate` in static batches of 8 in prompt order: the generate stage
of the hand-written index pipeline (`kvbatch bench index-cpu` times that pipeline whole,
embeddings and LanceDB included). Everything runs in this one process, one torch thread
unless --threads says more.

    kvbatch bench mixed-decode [--model PATH] [--rows 12] [--max-tokens 48] [--repeat 3]
                               [--before-tokens 8] [--no-peers] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pydoc
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import kvbatch.engine.attention.decode_plan as decode_plan
import kvbatch.engine.exec.runner as runner
from kvbatch.engine import LLM, SamplingParams
from kvbatch.index.prompts import CONTEXT_PROMPT

DOC_MODULES = ("json", "csv", "heapq")
DOC_TOKENS = (1500, 2000, 1000)  # each document's length, in the generation model's tokens
USER_BATCH = 8  # the static batch of the hand-written index pipeline's `generate`


@dataclass(frozen=True)
class Document:
    tokens: list[int]
    prompts: list[list[int]]  # the document, then one chunk with the instruction


def page_tokens(tokenizer, module: str, length: int) -> list[int]:
    """`length` tokens of pydoc's plain-text page of `module` (repeated if it is shorter)."""
    text = pydoc.render_doc(__import__(module), renderer=pydoc.plaintext)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def make_document(tokenizer, module: str, length: int, rows: int, chunk: int = 180) -> Document:
    """A document of about `length` tokens and `rows` chunk prompts over it as the index job's
    context stage writes them: its prompt (kvbatch.index.prompts) in the model's chat
    template, so every prompt starts with the template's system prompt, then the document."""
    doc = page_tokens(tokenizer, module, length)
    text = tokenizer.decode(doc)
    prompts = []
    for i in range(rows):
        start = (length - chunk) * i // max(rows - 1, 1)
        content = CONTEXT_PROMPT.format(
            document=text, chunk=tokenizer.decode(doc[start : start + chunk])
        )
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return Document(doc, prompts)


def first_block_groups(tables, context_lens, block_size, min_group=2, rows=None):
    """The decode grouping this replaced: rows grouped by their first block only, sharing the
    run common to all of them (under a chat template's system prompt: one group of every
    row, sharing the system prompt's block, each document in its rows' private parts)."""
    rows = np.arange(len(tables)) if rows is None else rows
    n = len(rows)
    order = np.argsort(tables[rows, 0], kind="stable")
    first = tables[rows[order], 0]
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1]])
    sizes = np.diff(np.r_[starts, n])
    caps = np.minimum.reduceat((context_lens[order] - 1) // block_size, starts)
    candidates = (sizes >= min_group) & (caps > 0)
    if not candidates.any():
        return order, []
    width = int(caps[candidates].max())
    ordered = tables[rows[order], :width]
    same = ordered == ordered[np.repeat(starts, sizes)]
    run = np.where(same.all(axis=1), width, same.argmin(axis=1))
    shared = np.minimum(np.minimum.reduceat(run, starts), caps)
    keep = candidates & (shared > 0)
    return order, [
        (s, s + size, k)
        for s, size, k in zip(starts[keep].tolist(), sizes[keep].tolist(), shared[keep].tolist())
    ]


@contextlib.contextmanager
def as_before(llm: LLM) -> Iterator[None]:
    """kvbatch's decode as it was: rows grouped by first block only, every row's private part
    padded to the longest row's (no length buckets), each shared prefix gathered at every
    step (no kept prefixes, no group of one for a long row), and admission that lets the next
    group's rows in one at a time."""
    backend = llm.engine.runner.backend
    saved = (backend.prefixes, decode_plan.length_buckets, runner.find_shared_prefixes)
    backend.prefixes, decode_plan.length_buckets = None, lambda lens: None
    runner.find_shared_prefixes = first_block_groups
    llm.engine.scheduler._may_open_group = lambda *a: True
    try:
        yield
    finally:
        backend.prefixes, decode_plan.length_buckets, runner.find_shared_prefixes = saved
        del llm.engine.scheduler._may_open_group


@dataclass
class DecodeRun:
    decode_ms: float  # median time of a step in which every scheduled chunk is a decode
    decode_cpu_ms: float  # median CPU time of this process in those steps
    decode_steps: int
    steps: int
    seconds: float
    prefill_tokens: int  # prompt tokens computed (not served from the prefix cache)
    tokens: list[list[int]]


def run_kvbatch(llm: LLM, prompts: Sequence[list[int]], max_tokens: int) -> DecodeRun:
    """All prompts at once through the engine, every step timed; a step counts as a decode
    step when every chunk the scheduler gave it is one token."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    kinds: list[bool] = []
    prefill = 0
    schedule = engine.scheduler.schedule

    def noting_schedule():
        nonlocal prefill
        out = schedule()
        kinds.append(bool(out.chunks) and all(c.num_new_tokens == 1 for c in out.chunks))
        for seq, n in out.chunks:  # the prompt's tokens in this chunk (recomputes included)
            prefill += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
        return out

    engine.scheduler.schedule = noting_schedule
    ids = [engine.add_request(list(p), params) for p in prompts]
    times, cpu_times, outputs = [], [], {}
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            t, c = time.perf_counter(), time.process_time()
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
            times.append(time.perf_counter() - t)
            cpu_times.append(time.process_time() - c)
    finally:
        del engine.scheduler.schedule
    seconds = time.perf_counter() - start
    decode = [t for t, k in zip(times, kinds) if k]
    decode_cpu = [t for t, k in zip(cpu_times, kinds) if k]
    return DecodeRun(
        1000 * _median(decode),
        1000 * _median(decode_cpu),
        len(decode),
        len(times),
        seconds,
        prefill,
        [list(outputs[i]) for i in ids],
    )


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class StaticRun:
    decode_ms: float  # decode time per step over all batches (first token to last)
    seconds: float
    prompt_tokens: int  # prefilled, left padding included


def run_transformers(
    model, prompts: Sequence[list[int]], max_tokens: int, pad: int, batch: int | None = None
) -> StaticRun:
    """transformers `generate` on the prompts in left-padded static batches of `batch` (None:
    one batch of all), in the order given, as a user's script batches them: decode ms per
    step (the time between the first and the last token of each batch, over its steps)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    size = batch or len(prompts)
    decode_s, steps, tokens = 0.0, 0, 0
    start = time.perf_counter()
    for first in range(0, len(prompts), size):
        part = prompts[first : first + size]
        width = max(map(len, part))
        ids = torch.full((len(part), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(part):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
        stamps.clear()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([Clock()]),
            )
        decode_s += stamps[-1] - stamps[0]
        steps += len(stamps) - 1
        tokens += ids.numel()
    return StaticRun(1000 * decode_s / max(steps, 1), time.perf_counter() - start, tokens)


def ideal_prefill(prompts: Sequence[list[int]], block_size: int) -> int:
    """Prompt tokens a perfect prefix cache computes: each distinct full block once, and every
    prompt's tail after its last shareable full block."""
    seen, total = set(), 0
    for p in prompts:
        full = (len(p) - 1) // block_size  # the last token is always computed
        for b in range(full):
            key = tuple(p[: (b + 1) * block_size])
            if key not in seen:
                seen.add(key)
                total += block_size
        total += len(p) - full * block_size
    return total


@dataclass
class Row:
    case: str
    engine: str
    decode_ms: float
    decode_cpu_ms: float = float("nan")
    decode_steps: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    ideal_prefill: int = 0


@dataclass
class Round:
    """One paired round: the one-document batch, then the mixed one, on the same engine."""

    one_ms: float
    one_cpu_ms: float
    mixed_ms: float
    mixed_cpu_ms: float


@dataclass
class Measured:
    rows: list[Row]
    rounds: list[Round]


def measure(
    model_path: str,
    rows: int,
    max_tokens: int,
    before_tokens: int,
    repeat: int = 3,
    block_size: int = 16,
    peers: bool = True,
) -> Measured:
    """The one-document and mixed batches in `repeat` paired rounds (kvbatch as it is), once
    as it was ("before", `before_tokens` output tokens: its mixed steps are slow; 0: not run),
    transformers on both in one static batch, then several documents through a pool that
    holds about one group beside transformers in static batches of 8 (the generate of the
    hand-written index pipeline). `peers=False` leaves transformers out."""
    llm = LLM(model=model_path, device="cpu", dtype="float32", block_size=block_size)
    tok = llm.tokenizer
    doc_a = make_document(tok, DOC_MODULES[0], DOC_TOKENS[0], rows)
    doc_b = make_document(tok, DOC_MODULES[1], DOC_TOKENS[1], rows)
    mixed = f"mixed {rows - 1} + 1"
    cases = {"one document": doc_a.prompts, mixed: doc_a.prompts[: rows - 1] + doc_b.prompts[:1]}
    out: list[Row] = []
    for prompts in cases.values():  # warm: prompts prefilled, kept prefixes made
        _run(llm, prompts, 4, contextlib.nullcontext())
    if before_tokens:
        for case, prompts in cases.items():
            before = _run(llm, prompts, before_tokens, as_before(llm))
            after = _run(llm, prompts, before_tokens, contextlib.nullcontext())
            if after.tokens != before.tokens:
                raise RuntimeError(f"{case}: kvbatch gave other greedy tokens than before")
            out.append(Row(case, "kvbatch before", before.decode_ms, before.decode_cpu_ms,
                           before.decode_steps, before.seconds))  # fmt: skip
    runs: dict[str, list[DecodeRun]] = {case: [] for case in cases}
    for _ in range(repeat):
        for case, prompts in cases.items():
            runs[case].append(_run(llm, prompts, max_tokens, contextlib.nullcontext()))
    for case, done in runs.items():
        out.append(
            Row(case, "kvbatch (median of rounds)",
                _median([r.decode_ms for r in done]), _median([r.decode_cpu_ms for r in done]),
                done[0].decode_steps, _median([r.seconds for r in done]))
        )  # fmt: skip
    one, mix = runs["one document"], runs[mixed]
    rounds = [
        Round(a.decode_ms, a.decode_cpu_ms, b.decode_ms, b.decode_cpu_ms) for a, b in zip(one, mix)
    ]
    del llm

    docs = [doc_a, doc_b, make_document(tok, DOC_MODULES[2], DOC_TOKENS[2], rows)]
    several = [p for d in docs for p in d.prompts]
    several_case = f"{len(docs)} documents x {rows}, pool ~1 group"
    if peers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        pad = hf.generation_config.pad_token_id or 0
        for case, prompts in cases.items():
            static = run_transformers(hf, prompts, max_tokens, pad)
            out.append(Row(case, "transformers (one static batch)", static.decode_ms))
        static = run_transformers(hf, several, max_tokens, pad, batch=USER_BATCH)
        out.append(
            Row(several_case, f"transformers, static batches of {USER_BATCH} (hand-written "
                "pipeline's generate)", static.decode_ms, seconds=static.seconds,
                prefill_tokens=static.prompt_tokens)
        )  # fmt: skip
        del hf

    # several documents through one pool that holds about one document group
    longest = max(map(len, several)) + max_tokens
    group_blocks = max(
        -(-len(d.prompts[0]) // block_size) + rows * (-(-(max_tokens + 200) // block_size) + 1)
        for d in docs
    )
    modes = [("kvbatch", max_tokens)] + ([("kvbatch before", before_tokens)] * bool(before_tokens))
    for name, tokens in modes:
        llm = LLM(
            model=model_path,
            device="cpu",
            dtype="float32",
            block_size=block_size,
            num_kv_blocks=group_blocks,
            max_model_len=longest,
            max_num_seqs=2 * rows,
        )
        then = as_before(llm) if name.endswith("before") else contextlib.nullcontext()
        run = _run(llm, several, tokens, then)
        out.append(
            Row(several_case, name, run.decode_ms, run.decode_cpu_ms, run.decode_steps,
                run.seconds, run.prefill_tokens, ideal_prefill(several, block_size))
        )  # fmt: skip
        del llm
    return Measured(out, rounds)


def _run(llm: LLM, prompts, max_tokens: int, mode) -> DecodeRun:
    with mode:
        return run_kvbatch(llm, prompts, max_tokens)


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| case | engine | decode ms/step (wall) | CPU | decode steps | seconds "
        "| prefill tokens (ideal) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        prefill = f"{r.prefill_tokens:,}" if r.prefill_tokens else ""
        prefill += f" ({r.ideal_prefill:,})" if r.ideal_prefill else ""
        steps = str(r.decode_steps) if r.decode_steps else ""
        secs = f"{r.seconds:.1f}" if r.seconds else ""
        cpu = "" if math.isnan(r.decode_cpu_ms) else f"{r.decode_cpu_ms:.0f}"
        lines.append(
            f"| {r.case} | {r.engine} | {r.decode_ms:.0f} | {cpu} | {steps} | {secs} | {prefill} |"
        )
    return "\n".join(lines)


def rounds_table(rounds: Sequence[Round]) -> str:
    """The paired rounds and the median of their ratios (wall and CPU time)."""
    lines = [
        "| round | one document ms/step (wall / CPU) | mixed (wall / CPU) | mixed / one (wall / CPU) |",
        "|---|---|---|---|",
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(
            f"| {i} | {r.one_ms:.0f} / {r.one_cpu_ms:.0f} | {r.mixed_ms:.0f} / {r.mixed_cpu_ms:.0f} "
            f"| {r.mixed_ms / r.one_ms:.2f} / {r.mixed_cpu_ms / r.one_cpu_ms:.2f} |"
        )
    wall = _median([r.mixed_ms / r.one_ms for r in rounds])
    cpu = _median([r.mixed_cpu_ms / r.one_cpu_ms for r in rounds])
    lines.append(f"| median | | | **{wall:.2f}** / **{cpu:.2f}** (target <= 1.2) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvbatch bench mixed-decode", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", help="a Llama-family HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rows", type=int, default=12, help="chunk prompts per document (12)")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per row (48)")
    p.add_argument("--repeat", type=int, default=3, help="paired rounds, one document / mixed (3)")
    p.add_argument(
        "--before-tokens",
        type=int,
        default=8,
        help="output tokens per row, kvbatch before (8; 0: leave it out)",
    )
    p.add_argument("--no-peers", action="store_true", help="leave transformers out")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from kvbatch.fetch import smollm2_dir

        args.model = str(smollm2_dir())
    got = measure(
        args.model, args.rows, args.max_tokens, args.before_tokens, args.repeat,
        peers=not args.no_peers,
    )  # fmt: skip
    print(table(got.rows))
    print()
    print(rounds_table(got.rounds))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"rows": [asdict(r) for r in got.rows], "rounds": [asdict(r) for r in got.rounds]},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
    several docs   3 documents x 12 rows through LLM.generate with a KV pool that holds about
                   one document group: decode ms per step and prefill tokens against the ideal

each for kvbatch as it is ("kvbatch") and as it was ("kvbatch before", `as_before`: rows
grouped by first block, private parts padded to the longest row, shared prefixes gathered
every step, the next group's rows admitted one at a time; fewer output tokens, as its mixed
steps are slow) and, for the first two, transformers `generate` on the same 12 prompts in one
static batch. Everything runs in this one process, one torch thread unless --threads says
more.

    kvbatch bench mixed-decode [--model PATH] [--rows 12] [--max-tokens 48] [--before-tokens 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pydoc
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

import kvbatch.engine.attention.decode_rows as decode_rows
import kvbatch.engine.exec.runner as runner
from kvbatch.engine import LLM, SamplingParams
from kvbatch.index.prompts import CONTEXT_PROMPT

DOC_MODULES = ("json", "csv", "heapq")


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
    saved = (backend.prefixes, decode_rows.length_buckets, runner.find_shared_prefixes)
    backend.prefixes, decode_rows.length_buckets = None, lambda lens: None
    runner.find_shared_prefixes = first_block_groups
    llm.engine.scheduler._may_open_group = lambda *a: True
    try:
        yield
    finally:
        backend.prefixes, decode_rows.length_buckets, runner.find_shared_prefixes = saved
        del llm.engine.scheduler._may_open_group


@dataclass
class DecodeRun:
    decode_ms: float  # median time of a step in which every scheduled chunk is a decode
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
    times, outputs = [], {}
    start = time.perf_counter()
    try:
        while engine.has_unfinished():
            t = time.perf_counter()
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
            times.append(time.perf_counter() - t)
    finally:
        del engine.scheduler.schedule
    seconds = time.perf_counter() - start
    decode = sorted(t for t, k in zip(times, kinds) if k)
    return DecodeRun(
        1000 * decode[len(decode) // 2] if decode else float("nan"),
        len(decode),
        len(times),
        seconds,
        prefill,
        [list(outputs[i]) for i in ids],
    )


def run_transformers(model, prompts: Sequence[list[int]], max_tokens: int, pad: int) -> float:
    """transformers `generate` on the prompts in one left-padded static batch: ms per decode
    step (the time between the first and the last token over the steps between)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
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
    return 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


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
    decode_steps: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    ideal_prefill: int = 0


def measure(
    model_path: str, rows: int, max_tokens: int, before_tokens: int, block_size: int = 16
) -> list[Row]:
    """The three cases, kvbatch as it was ("before", `before_tokens` output tokens: its mixed
    steps are slow) and as it is, and transformers for the first two."""
    llm = LLM(model=model_path, device="cpu", dtype="float32", block_size=block_size)
    tok = llm.tokenizer
    doc_a = make_document(tok, DOC_MODULES[0], 1500, rows)
    doc_b = make_document(tok, DOC_MODULES[1], 2000, rows)
    cases = {
        "one document": doc_a.prompts,
        f"mixed {rows - 1} + 1": doc_a.prompts[: rows - 1] + doc_b.prompts[:1],
    }
    out: list[Row] = []
    for case, prompts in cases.items():
        before = _run(llm, prompts, before_tokens, as_before(llm))
        after = _run(llm, prompts, max_tokens, contextlib.nullcontext())
        if [t[:before_tokens] for t in after.tokens] != before.tokens:
            raise RuntimeError(f"{case}: kvbatch gave other greedy tokens than before")
        out.append(
            Row(case, "kvbatch before", before.decode_ms, before.decode_steps, before.seconds)
        )
        out.append(Row(case, "kvbatch", after.decode_ms, after.decode_steps, after.seconds))
    del llm
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad = hf.generation_config.pad_token_id or 0
    for case, prompts in cases.items():
        out.append(Row(case, "transformers", run_transformers(hf, prompts, max_tokens, pad)))
    del hf

    # several documents through one pool that holds about one document group
    docs = [doc_a, doc_b, make_document(tok, DOC_MODULES[2], 1000, rows)]
    prompts = [p for d in docs for p in d.prompts]
    longest = max(map(len, prompts)) + max_tokens
    group_blocks = max(
        -(-len(d.prompts[0]) // block_size) + rows * (-(-(max_tokens + 200) // block_size) + 1)
        for d in docs
    )
    for name, tokens in (("kvbatch before", before_tokens), ("kvbatch", max_tokens)):
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
        run = _run(llm, prompts, tokens, then)
        case = f"{len(docs)} documents, pool ~1 group"
        out.append(
            Row(
                case,
                name,
                run.decode_ms,
                run.decode_steps,
                run.seconds,
                run.prefill_tokens,
                ideal_prefill(prompts, block_size),
            )
        )
        del llm
    return out


def _run(llm: LLM, prompts, max_tokens: int, mode) -> DecodeRun:
    with mode:
        return run_kvbatch(llm, prompts, max_tokens)


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| case | engine | decode ms/step | decode steps | seconds | prefill tokens (ideal) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        prefill = f"{r.prefill_tokens:,} ({r.ideal_prefill:,})" if r.ideal_prefill else ""
        steps = str(r.decode_steps) if r.decode_steps else ""
        secs = f"{r.seconds:.1f}" if r.seconds else ""
        lines.append(
            f"| {r.case} | {r.engine} | {r.decode_ms:.0f} | {steps} | {secs} | {prefill} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvbatch bench mixed-decode", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", help="a Llama-family HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--rows", type=int, default=12, help="chunk prompts per document (12)")
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per row (48)")
    p.add_argument(
        "--before-tokens", type=int, default=8, help="output tokens per row, kvbatch before (8)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from kvbatch.fetch import smollm2_dir

        args.model = str(smollm2_dir())
    rows = measure(args.model, args.rows, args.max_tokens, args.before_tokens)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

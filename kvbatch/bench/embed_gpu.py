"""`kvbatch bench embed-gpu [--tiny] [--models NAME,NAME] [--repeat N] [--json PATH]`

Prefill-only throughput of kvbatch's `LLM.embed` on the shapes of two embedding models that
batch jobs use (a BERT-base encoder such as bge-base, and Qwen3-Embedding-0.6B, a decoder
pooled at its last token), random weights, token ids in: how far from the hardware's floor
the embedding path runs.

The peer is the same checkpoint run as sentence-transformers runs it: transformers'
`AutoModel` over batches of the inputs sorted longest first, each padded to its longest,
then the pooling its module files name and L2 normalisation. sentence-transformers itself is
not on the GPU machine, so its batching is written out here (`SortedBatchesPeer`); the CPU
test checks that the folder and the peer give sentence-transformers' own vectors.

Every row states its floor: the forward's FLOPs (2 x parameters x tokens, plus attention's
4 x layers x width x length^2 per text, halved for a causal model) at the matmul rate this
device reaches on a large square GEMM of the benchmark's dtype, measured at the start.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvbatch.bench.embed_models import (
    EMBED_GPU_MODELS,
    TINY_EMBED_GPU_MODELS,
    EmbedModelSpec,
    build_embed_model,
)
from kvbatch.bench.machine import machine_info
from kvbatch.bench.text_table import format_rows
from kvbatch.engine import LLM
from kvbatch.engine.encoder.batches import EncoderRequest, LengthBatcher
from kvbatch.engine.encoder.engine import EncoderEngine

MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.99, "float16": 0.995}
"""Per input, between kvbatch's vector and the peer's: the same weights and pooling, so only
the order of floating-point sums differs (wider in half precision)."""


@dataclass(frozen=True)
class EmbedGpuWorkload:
    """`num_inputs` token-id inputs with lengths drawn log-uniformly from `min_tokens` to
    `max_tokens` (many short chunks and queries, fewer long passages)."""

    num_inputs: int
    min_tokens: int
    max_tokens: int
    batch_sizes: tuple[int, ...] = (32, 128)
    seed: int = 0

    def inputs(self, vocab_size: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        low, high = np.log(self.min_tokens), np.log(self.max_tokens)
        lengths = np.exp(rng.uniform(low, high, self.num_inputs)).round().astype(int)
        # ids from 10 up: clear of the pad, CLS/SEP and BOS/EOS ids of either model family
        return [rng.integers(10, vocab_size, int(n)).tolist() for n in lengths]


WORKLOAD = EmbedGpuWorkload(num_inputs=4096, min_tokens=16, max_tokens=510)
TINY_WORKLOAD = EmbedGpuWorkload(num_inputs=48, min_tokens=4, max_tokens=60, batch_sizes=(8,))


class Embedder:
    """One engine under test: `embed(inputs)` -> [n, dim] float32 vectors in input order."""

    label: str

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        raise NotImplementedError

    def padded_tokens(self, inputs: list[list[int]]) -> int:
        raise NotImplementedError


class KvbatchPeer(Embedder):
    label = "kvbatch"

    def __init__(self, folder: Path, device: str, dtype: str) -> None:
        self.llm = LLM(model=str(folder), device=device, dtype=dtype)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        return np.asarray(self.llm.embed(inputs), dtype=np.float32)

    def padded_tokens(self, inputs: list[list[int]]) -> int:
        """Decoders run packed (no padding); encoders in the engine's length-sorted batches,
        replayed here on the lengths with every input waiting at once."""
        engine = self.llm.engine
        if not isinstance(engine, EncoderEngine):
            return sum(map(len, inputs))
        batcher = LengthBatcher()
        for i, ids in enumerate(inputs):
            batcher.add(EncoderRequest(str(i), None, ids, i))
        total = 0
        while batch := batcher.next_batch(engine.max_batch_tokens, engine.max_num_seqs):
            total += len(batch) * max(len(r) for r in batch)
        return total


class SortedBatchesPeer(Embedder):
    """transformers' AutoModel with sentence-transformers' batching: inputs sorted longest
    first, batches of `batch_size` padded to their longest (right padding, attention mask),
    then the pooling of the checkpoint's module files and L2 normalisation."""

    def __init__(
        self, spec: EmbedModelSpec, folder: Path, device: str, dtype: str, batch_size: int
    ):
        from transformers import AutoModel

        self.spec, self.device, self.batch_size = spec, device, batch_size
        self.label = f"transformers, st batching {batch_size}"
        self.model = AutoModel.from_pretrained(str(folder), dtype=getattr(torch, dtype))
        self.model.to(device).eval()

    def _batches(self, inputs: list[list[int]]) -> list[list[int]]:
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        out = [None] * len(inputs)
        for batch in self._batches(inputs):
            longest = max(len(inputs[i]) for i in batch)
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
                mask[row, : len(inputs[i])] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            pooled = pool(hidden, mask, self.spec.pooling)
            vectors = torch.nn.functional.normalize(pooled, dim=-1).cpu()
            for row, i in enumerate(batch):
                out[i] = vectors[row]
        return torch.stack(out).numpy()

    def padded_tokens(self, inputs: list[list[int]]) -> int:
        return sum(len(b) * max(len(inputs[i]) for i in b) for b in self._batches(inputs))


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """sentence-transformers' Pooling modes over right-padded rows."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = mask.sum(dim=1) - 1
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    if mode == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
    raise ValueError(f"unknown pooling mode {mode!r}")


def matmul_peak_flops(device: str, dtype: str, size: int) -> float:
    """FLOP/s of a square GEMM of `size`: the rate this device reaches, the floor's unit."""
    a = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    for _ in range(2):
        a @ b
    _sync(device)
    reps, start = 5, time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - start)


def forward_flops(spec: EmbedModelSpec, inputs: list[list[int]]) -> float:
    """The useful FLOPs of one pass over `inputs` (no padding): dense layers plus attention."""
    per_token = 2 * spec.non_embedding_parameters()
    attention = 4 * spec.num_layers * spec.attention_width * (0.5 if spec.causal else 1.0)
    return sum(per_token * len(x) + attention * len(x) ** 2 for x in inputs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass
class Row:
    label: str
    seconds: list[float] = field(default_factory=list)
    padded_tokens: int = 0
    min_cosine: float | None = None


def measure_model(
    spec: EmbedModelSpec,
    workload: EmbedGpuWorkload,
    folder: Path,
    device: str,
    dtype: str,
    repeat: int,
    progress: Callable[[str], None],
) -> dict:
    """kvbatch and the sorted-batches peer on one model, interleaved; vectors compared."""
    inputs = workload.inputs(spec.vocab_size)
    engines: list[Embedder] = [KvbatchPeer(folder, device, dtype)]
    engines += [SortedBatchesPeer(spec, folder, device, dtype, b) for b in workload.batch_sizes]
    rows = [Row(e.label, padded_tokens=e.padded_tokens(inputs)) for e in engines]
    reference = None
    for engine, row in zip(engines, rows):  # untimed warm-up: allocator growth, compiles
        vectors = engine.embed(inputs)
        if reference is None:
            reference = vectors
        else:
            row.min_cosine = float(np.min(np.sum(vectors * reference, axis=1)))
    for r in range(repeat):
        for engine, row in zip(
            engines if r % 2 == 0 else engines[::-1], rows if r % 2 == 0 else rows[::-1]
        ):
            _sync(device)
            start = time.perf_counter()
            engine.embed(inputs)
            _sync(device)
            row.seconds.append(time.perf_counter() - start)
            progress(f"{spec.name}: {row.label} {row.seconds[-1]:.3f} s")
    tokens = sum(map(len, inputs))
    flops = forward_flops(spec, inputs)
    return {
        "model": spec.name,
        "inputs": len(inputs),
        "tokens": tokens,
        "flops": flops,
        "rows": [
            dict(
                dataclasses.asdict(row),
                median_seconds=statistics.median(row.seconds),
                tokens_per_s=tokens / statistics.median(row.seconds),
            )
            for row in rows
        ],
    }


def format_report(report: dict) -> str:
    peak = report["matmul_flops"]
    m = report["machine"]
    lines = [
        f"embed-gpu on {m['device_name']} ({m['device']}), {report['dtype']}, torch {m['torch']}, "
        f"transformers {m['transformers']}; matmul peak measured {peak / 1e12:.3g} TFLOP/s; "
        f"median of {report['repeat']} run(s)",
        "",
    ]
    for model in report["models"]:
        floor_s = model["flops"] / peak
        kvbatch_s = model["rows"][0]["median_seconds"]
        lines.append(
            f"{model['model']}: {model['inputs']} inputs, {model['tokens']} tokens, "
            f"floor {floor_s:.3f} s ({model['flops'] / 1e12:.2f} TFLOP)"
        )
        table = [
            (
                "engine",
                "seconds",
                "tokens/s",
                "padded tokens",
                "of floor",
                "vs kvbatch",
                "min cosine",
            )
        ]
        for row in model["rows"]:
            table.append(
                (
                    row["label"],
                    f"{row['median_seconds']:.3f}",
                    f"{row['tokens_per_s']:,.0f}",
                    f"{row['padded_tokens']:,}",
                    f"{floor_s / row['median_seconds']:.0%}",
                    f"{row['median_seconds'] / kvbatch_s:.2f}x",
                    "reference" if row["min_cosine"] is None else f"{row['min_cosine']:.5f}",
                )
            )
        lines += format_rows(table) + [""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbatch bench embed-gpu", description=__doc__.split("\n\n")[1]
    )
    p.add_argument(
        "--tiny", action="store_true", help="tiny random models and 48 short inputs (the CPU test)"
    )
    p.add_argument(
        "--models", help="comma-separated: " + ", ".join(EMBED_GPU_MODELS) + " (default: all)"
    )
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per engine (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on the CPU")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where the random models are built (default: kvbatch's cache)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    table = TINY_EMBED_GPU_MODELS if args.tiny else EMBED_GPU_MODELS
    names = args.models.split(",") if args.models else list(table)
    unknown = [n for n in names if n not in table]
    if unknown or args.repeat < 1:
        why = (
            f"unknown model(s) {unknown}; known: {', '.join(table)}"
            if unknown
            else "--repeat must be >= 1"
        )
        print(f"kvbatch bench embed-gpu: error: {why}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    workload = TINY_WORKLOAD if args.tiny else WORKLOAD
    progress = lambda m: print(m, file=sys.stderr, flush=True)
    report = {
        "kind": "embed-gpu",
        "dtype": dtype,
        "repeat": args.repeat,
        "workload": dataclasses.asdict(workload),
        "machine": machine_info(device),
        "matmul_flops": matmul_peak_flops(device, dtype, 512 if args.tiny else 8192),
        "models": [],
    }
    for name in names:
        spec = table[name]
        folder = build_embed_model(spec, dtype, args.cache_dir)
        report["models"].append(
            measure_model(spec, workload, folder, device, dtype, args.repeat, progress)
        )
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    worst = [
        (m["model"], r["label"], r["min_cosine"])
        for m in report["models"]
        for r in m["rows"]
        if r["min_cosine"] is not None and r["min_cosine"] < MIN_COSINE.get(dtype, 0.99)
    ]
    if worst:
        print(f"kvbatch bench embed-gpu: the vectors disagree: {worst}", file=sys.stderr)
        return 1
    return 0
